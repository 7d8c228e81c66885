"""Malformed checkpoints given to ``load_target`` / ``load_drafter``: hostile torch pickles and
zips, safetensors indexes, weights, configs and arguments.  Each case asserts the exception
type and that the message names the offending file and tensor or key.  The crafted
out-of-bounds file and the zip bombs are also refused fast and in bounded memory.

Checkpoints are built here, tiny: safetensors with ``safetensors.numpy``, ``pytorch_model.bin``
written opcode by opcode as ``torch.save`` writes it (``checkpoint_forge``).
"""

from __future__ import annotations

import json
import os
import pickle
import time
import tracemalloc
import zipfile
import zlib

import numpy as np
import pytest
from safetensors.numpy import save_file

import eagle3_jax
from checkpoint_forge import Entry, TensorSpec, deflated_zeros, torch_entries, torch_pickle, write_zip
from eagle3_jax.checkpoint import TorchPickleSource

H, I, V, DV, NH, KV, HD, L = 16, 24, 32, 16, 2, 1, 8, 7
EMBED = np.zeros((V, H), np.float32)

TARGET_CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=H, intermediate_size=I,
                     num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV, head_dim=HD, vocab_size=V,
                     max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                     torch_dtype="float32")
DRAFTER_CONFIG = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=H, intermediate_size=I,
                      num_attention_heads=NH, num_key_value_heads=KV, head_dim=HD, vocab_size=V, draft_vocab_size=DV,
                      target_hidden_size=H, rms_norm_eps=1e-5, rope_theta=10000.0)


def target_tensors() -> dict[str, np.ndarray]:
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (NH * HD, H), p + "self_attn.k_proj.weight": (KV * HD, H),
                       p + "self_attn.v_proj.weight": (KV * HD, H), p + "self_attn.o_proj.weight": (H, NH * HD),
                       p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def drafter_tensors() -> dict[str, np.ndarray]:
    m = "midlayer."
    shapes = {"fc.weight": (H, 3 * H), m + "hidden_norm.weight": (H,), m + "input_layernorm.weight": (H,),
              m + "post_attention_layernorm.weight": (H,), m + "self_attn.q_proj.weight": (NH * HD, 2 * H),
              m + "self_attn.k_proj.weight": (KV * HD, 2 * H), m + "self_attn.v_proj.weight": (KV * HD, 2 * H),
              m + "self_attn.o_proj.weight": (H, NH * HD), m + "mlp.gate_proj.weight": (I, H),
              m + "mlp.up_proj.weight": (I, H), m + "mlp.down_proj.weight": (H, I), "norm.weight": (H,),
              "lm_head.weight": (DV, H)}
    rng = np.random.default_rng(1)
    t = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    t["d2t"] = np.arange(DV, dtype=np.int64)  # draft id i -> target id 2i
    t["t2d"] = np.arange(V) % 2 == 0
    return t


def write_config(d, config, **edits):
    d.mkdir(parents=True, exist_ok=True)
    config = {**config, **edits}
    (d / "config.json").write_text(json.dumps(config))
    return d


def make_target(d, *, config=None, edit=None, shards: int = 0):
    """A tiny Llama target in ``d`` (``shards`` > 0: sharded with an index)."""
    write_config(d, config or TARGET_CONFIG)
    tensors = target_tensors()
    if edit:
        edit(tensors)
    if not shards:
        save_file(tensors, d / "model.safetensors")
        return d
    names, weight_map = list(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, d / file)
        weight_map.update(dict.fromkeys(part, file))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def torch_specs(tensors: dict[str, np.ndarray]):
    """``(specs, blobs)`` of a ``torch.save`` of ``tensors`` (one contiguous storage each)."""
    kinds = {"float32": "FloatStorage", "int64": "LongStorage", "bool": "BoolStorage", "int32": "IntStorage"}
    specs, blobs = [], {}
    for i, (name, arr) in enumerate(tensors.items()):
        arr = np.ascontiguousarray(arr)
        stride = tuple(s // arr.itemsize for s in arr.strides)
        specs.append(TensorSpec(name, str(i), kinds[arr.dtype.name], arr.size, 0, arr.shape, stride))
        blobs[str(i)] = arr.tobytes()
    return specs, blobs


def make_drafter_bin(d, *, edit=None, pkl=None, entries=None, tensors=None):
    """A tiny drafter with ``pytorch_model.bin`` in ``d``; ``edit(specs, blobs)`` mutates the
    state dict, ``pkl`` replaces the pickle, ``entries(list)`` the zip entries."""
    write_config(d, DRAFTER_CONFIG)
    specs, blobs = torch_specs(tensors or drafter_tensors())
    if edit:
        edit({s.name: s for s in specs}, blobs)
    zentries = torch_entries(torch_pickle(specs) if pkl is None else pkl, blobs)
    if entries:
        zentries = entries(zentries)
    write_zip(d / "pytorch_model.bin", zentries)
    return d


def make_drafter_st(d, *, edit=None, config=None):
    write_config(d, config or DRAFTER_CONFIG)
    tensors = drafter_tensors()
    if edit:
        edit(tensors)
    save_file(tensors, d / "model.safetensors")
    return d


def load_drafter(d):
    return lambda: eagle3_jax.load_drafter(d, embed=EMBED)


def load_target(d, **kw):
    return lambda: eagle3_jax.load_target(d, **kw)


def one_tensor_pickle(spec: TensorSpec) -> bytes:
    """``{name: tensor}`` as a plain-dict pickle (for hand edits around the tensor)."""
    return torch_pickle([spec], ordered=False)


# ------------------------------------------------------------------ the cases
# name -> (builder(tmp_path) -> (call, needles), exception type); every needle must be in the message
CASES = {}


def case(exc):
    def register(fn):
        CASES[fn.__name__] = (fn, exc)
        return fn
    return register


def _set(name, **fields):
    def edit(specs, blobs):
        for k, v in fields.items():
            if k == "blob":
                blobs[specs[name].key] = v
            else:
                setattr(specs[name], k, v)
    return edit


# --- torch pickles: tensors against their storages
@case(ValueError)
def pickle_4_byte_storage_declared_as_4096_floats(tmp):
    d = make_drafter_bin(tmp / "d", edit=_set("fc.weight", numel=4096, size=(4096,), stride=(1,), blob=b"\1\2\3\4"))
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'fc.weight'", "holds 4 bytes", "declares 16384"]


@case(ValueError)
def pickle_4096_floats_viewed_in_4_byte_storage(tmp):
    d = make_drafter_bin(tmp / "d", edit=_set("fc.weight", numel=1, size=(4096,), stride=(1,), blob=b"\1\2\3\4"))
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'fc.weight'", "outside storage"]


@case(ValueError)
def pickle_1e9_floats_viewed_in_4_byte_storage(tmp):
    d = make_drafter_bin(tmp / "d", edit=_set("fc.weight", numel=1, size=(10**9,), stride=(1,), blob=b"\1\2\3\4"))
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'fc.weight'", "1000000000 elements"]


@case(ValueError)
def pickle_stride_past_storage(tmp):
    d = make_drafter_bin(tmp / "d", edit=_set("norm.weight", stride=(2,)))
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'norm.weight'", "outside storage"]


@case(ValueError)
def pickle_negative_stride(tmp):
    d = make_drafter_bin(tmp / "d", edit=_set("norm.weight", stride=(-1,)))
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'norm.weight'", "negative"]


@case(ValueError)
def pickle_negative_offset(tmp):
    d = make_drafter_bin(tmp / "d", edit=_set("norm.weight", offset=-4))
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'norm.weight'", "negative"]


@case(ValueError)
def pickle_offset_at_storage_end(tmp):
    d = make_drafter_bin(tmp / "d", edit=_set("norm.weight", offset=H))
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'norm.weight'", "outside storage"]


@case(ValueError)
def pickle_size_and_stride_of_different_rank(tmp):
    d = make_drafter_bin(tmp / "d", edit=_set("fc.weight", stride=(1,)))
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'fc.weight'", "malformed size/stride/offset"]


@case(ValueError)
def pickle_float_size(tmp):
    d = make_drafter_bin(tmp / "d", edit=_set("norm.weight", size=(16.0,)))
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'norm.weight'", "malformed size/stride/offset"]


@case(ValueError)
def pickle_storage_entry_missing(tmp):
    d = make_drafter_bin(tmp / "d", edit=_set("norm.weight", key="99"))
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'norm.weight'", "'archive/data/99'", "missing"]


@case(ValueError)
def pickle_storage_shared_with_two_types(tmp):
    def edit(specs, blobs):
        specs["norm.weight"].key = specs["midlayer.hidden_norm.weight"].key
        specs["norm.weight"].storage = "IntStorage"
    d = make_drafter_bin(tmp / "d", edit=edit)
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'norm.weight'", "declared twice"]


# --- torch pickles: what the pickle may build
@case(pickle.UnpicklingError)
def pickle_global_os_system(tmp):
    d = make_drafter_bin(tmp / "d", pkl=b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueK\x01\x86R.")
    return load_drafter(d), [str(d / "pytorch_model.bin"), "refusing to load global os.system"]


@case(ValueError)  # also a pickle.UnpicklingError
def pickle_unsupported_storage_type(tmp):
    d = make_drafter_bin(tmp / "d", edit=_set("norm.weight", storage="ComplexFloatStorage"))
    return load_drafter(d), [str(d / "pytorch_model.bin"), "torch.ComplexFloatStorage"]


@case(ValueError)
def pickle_state_set_on_a_tensor(tmp):
    pkl = one_tensor_pickle(TensorSpec("norm.weight", "0", "FloatStorage", H, 0, (H,), (1,)))
    pkl = pkl[:-2] + b"}b" + pkl[-2:]  # BUILD {} on the tensor, before SETITEMS
    d = make_drafter_bin(tmp / "d", pkl=pkl)
    return load_drafter(d), [str(d / "pytorch_model.bin"), "refusing to set the state of a _TensorRef"]


@case(ValueError)
def pickle_top_level_list(tmp):
    d = make_drafter_bin(tmp / "d", pkl=b"\x80\x02](K\x01e.")
    return load_drafter(d), [str(d / "pytorch_model.bin"), "expected a state dict, got list"]


@case(ValueError)
def pickle_integer_key(tmp):
    pkl = one_tensor_pickle(TensorSpec("w", "0", "FloatStorage", H, 0, (H,), (1,)))
    pkl = pkl.replace(b"X\x01\x00\x00\x00w", b"K\x07", 1)
    d = make_drafter_bin(tmp / "d", pkl=pkl)
    return load_drafter(d), [str(d / "pytorch_model.bin"), "state-dict key 7 is not a string"]


@case(ValueError)
def pickle_value_not_a_tensor(tmp):
    d = make_drafter_bin(tmp / "d", pkl=b"\x80\x02}(X\x09\x00\x00\x00fc.weightK\x05u.")
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'fc.weight' is not a tensor (got int)"]


@case(ValueError)
def pickle_truncated(tmp):
    specs, _ = torch_specs(drafter_tensors())
    d = make_drafter_bin(tmp / "d", pkl=torch_pickle(specs)[:-40])
    return load_drafter(d), [str(d / "pytorch_model.bin"), "malformed data.pkl (truncated)"]


@case(ValueError)
def pickle_unknown_opcode(tmp):
    d = make_drafter_bin(tmp / "d", pkl=b"\x80\x02}\xff.")
    return load_drafter(d), [str(d / "pytorch_model.bin"), "malformed data.pkl (unknown opcode 255)"]


@case(ValueError)
def pickle_data_pkl_over_16_mib(tmp):
    big = Entry("archive/data.pkl", deflated_zeros(17), zipfile.ZIP_DEFLATED, file_size=17 << 20, crc=0)
    d = make_drafter_bin(tmp / "d", entries=lambda es: [big] + es[1:])
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'archive/data.pkl'", "more than the 16777216 allowed"]


# --- torch zips
@case(ValueError)
def zip_bomb_entry_larger_than_declared(tmp):  # 2 MB file, a 2 GiB entry where the pickle declares 64 bytes
    bomb = Entry("archive/data/11", deflated_zeros(2048), zipfile.ZIP_DEFLATED, file_size=2 << 30, crc=0)
    d = make_drafter_bin(tmp / "d", entries=lambda es: [bomb if e.name == bomb.name else e for e in es])
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'norm.weight'", "holds 2147483648 bytes"]


@case(ValueError)
def zip_bomb_entry_declared_by_the_pickle(tmp):  # the pickle declares the 2 GiB too: the inflation cap
    bomb = Entry("archive/data/11", deflated_zeros(2048), zipfile.ZIP_DEFLATED, file_size=2 << 30, crc=0)
    d = make_drafter_bin(tmp / "d", edit=_set("norm.weight", numel=1 << 29),
                         entries=lambda es: [bomb if e.name == bomb.name else e for e in es])
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'norm.weight'", "zip bomb"]


@case(ValueError)
def zip_bomb_header_lies(tmp):  # the header says 64 bytes, the stream holds 2 GiB
    bomb = Entry("archive/data/11", deflated_zeros(2048), zipfile.ZIP_DEFLATED, file_size=4 * H, crc=1)
    d = make_drafter_bin(tmp / "d", entries=lambda es: [bomb if e.name == bomb.name else e for e in es])
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'norm.weight'", "corrupt"]


@case(ValueError)
def zip_storage_crc_mismatch(tmp):
    def entries(es):
        e = next(e for e in es if e.name == "archive/data/11")
        e.crc = zlib.crc32(e.data) ^ 1
        return es
    d = make_drafter_bin(tmp / "d", entries=entries)
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'archive/data/11'", "Bad CRC-32"]


@case(ValueError)
def zip_storage_bzip2_compressed(tmp):
    def entries(es):
        next(e for e in es if e.name == "archive/data/11").method = zipfile.ZIP_BZIP2
        return es
    d = make_drafter_bin(tmp / "d", entries=entries)
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'archive/data/11'", "compression method 12"]


@case(ValueError)
def zip_big_endian(tmp):
    d = make_drafter_bin(tmp / "d", entries=lambda es: [Entry(e.name, b"big") if e.name.endswith("byteorder") else e
                                                      for e in es])
    return load_drafter(d), [str(d / "pytorch_model.bin"), "byte order b'big'"]


@case(ValueError)
def zip_without_data_pkl(tmp):
    d = make_drafter_bin(tmp / "d", entries=lambda es: es[1:])
    return load_drafter(d), [str(d / "pytorch_model.bin"), "no data.pkl"]


@case(ValueError)
def zip_empty_file(tmp):
    d = make_drafter_bin(tmp / "d")
    (d / "pytorch_model.bin").write_bytes(b"")
    return load_drafter(d), [str(d / "pytorch_model.bin"), "corrupt or legacy"]


# --- safetensors indexes
@case(ValueError)
def index_names_parent_directory(tmp):
    d = make_target(tmp / "t", shards=2)
    save_file({"x": np.zeros(1, np.float32)}, tmp / "outside.safetensors")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../outside.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return load_target(d), [str(d / "model.safetensors.index.json"), "'model.norm.weight'", "'../outside.safetensors'"]


@case(ValueError)
def index_names_absolute_path(tmp):
    d = make_target(tmp / "t", shards=2)
    save_file({"x": np.zeros(1, np.float32)}, tmp / "outside.safetensors")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = str(tmp / "outside.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return load_target(d), [str(d / "model.safetensors.index.json"), "'lm_head.weight'", "outside.safetensors"]


@case(ValueError)
def index_shard_symlinks_out_of_directory(tmp):
    d = make_target(tmp / "t", shards=2)
    shard = d / "model-00002-of-00002.safetensors"
    shard.rename(tmp / "elsewhere.safetensors")
    os.symlink(tmp / "elsewhere.safetensors", shard)
    return load_target(d), [str(d / "model.safetensors.index.json"), "'model-00002-of-00002.safetensors'",
                            "not a file inside the checkpoint directory"]


@case(ValueError)
def index_weight_map_is_a_list(tmp):
    d = make_target(tmp / "t", shards=2)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model-00001-of-00002.safetensors"]}))
    return load_target(d), [str(d / "model.safetensors.index.json"), "'weight_map' must be an object"]


@case(ValueError)
def index_weight_map_file_is_a_number(tmp):
    d = make_target(tmp / "t", shards=2)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": 1}}))
    return load_target(d), [str(d / "model.safetensors.index.json"), "'weight_map' must be an object"]


@case(ValueError)
def index_not_json(tmp):
    d = make_target(tmp / "t", shards=2)
    (d / "model.safetensors.index.json").write_text('{"weight_map": {')
    return load_target(d), [str(d / "model.safetensors.index.json"), "malformed safetensors index"]


@case(FileNotFoundError)
def index_shard_missing(tmp):
    d = make_target(tmp / "t", shards=2)
    (d / "model-00001-of-00002.safetensors").unlink()
    return load_target(d), [str(d / "model-00001-of-00002.safetensors"), "missing"]


# --- weights
@case(ValueError)
def target_weight_holds_nan(tmp):
    d = make_target(tmp / "t", edit=lambda t: t["model.layers.3.mlp.up_proj.weight"].__setitem__((1, 2), np.nan))
    return load_target(d), [str(d / "model.safetensors"), "'model.layers.3.mlp.up_proj.weight'", "NaN or infinite"]


@case(ValueError)
def target_embedding_holds_inf(tmp):
    d = make_target(tmp / "t", shards=2, edit=lambda t: t["model.embed_tokens.weight"].__setitem__((0, 0), np.inf))
    return load_target(d), ["model-0000", "'model.embed_tokens.weight'", "NaN or infinite"]


@case(ValueError)
def drafter_bin_weight_holds_nan(tmp):
    tensors = drafter_tensors()
    tensors["midlayer.mlp.down_proj.weight"][0, 0] = np.nan
    d = make_drafter_bin(tmp / "d", tensors=tensors)
    return load_drafter(d), [str(d / "pytorch_model.bin"), "'midlayer.mlp.down_proj.weight'", "NaN or infinite"]


@case(ValueError)
def target_integer_weight(tmp):
    d = make_target(tmp / "t", edit=lambda t: t.update({"model.norm.weight": np.ones(H, np.int32)}))
    return load_target(d), [str(d / "model.safetensors"), "'model.norm.weight'", "floating point"]


@case(ValueError)
def target_shape_disagrees_with_config(tmp):
    d = make_target(tmp / "t", config={**TARGET_CONFIG, "intermediate_size": I + 2})
    return load_target(d), [str(d / "model.safetensors"), "'model.layers.0.mlp.gate_proj.weight'", "expected shape"]


@case(KeyError)
def target_tensor_missing(tmp):
    d = make_target(tmp / "t", edit=lambda t: t.pop("model.layers.6.self_attn.k_proj.weight"))
    return load_target(d), [str(d), "'model.layers.6.self_attn.k_proj.weight'", "missing"]


@case(ValueError)
def drafter_d2t_floats(tmp):
    d = make_drafter_st(tmp / "d", edit=lambda t: t.update(d2t=t["d2t"].astype(np.float32)))
    return load_drafter(d), [str(d / "model.safetensors"), "'d2t'", "expected integers"]


@case(ValueError)
def drafter_t2d_wrong_length(tmp):
    d = make_drafter_st(tmp / "d", edit=lambda t: t.update(t2d=t["t2d"][:-1]))
    return load_drafter(d), [str(d / "model.safetensors"), "'t2d'", f"expected ({V},)"]


@case(ValueError)
def drafter_two_names_for_one_tensor(tmp):
    d = make_drafter_st(tmp / "d", edit=lambda t: t.update({"model.fc.weight": t["fc.weight"]}))
    return load_drafter(d), [str(d / "model.safetensors"), "'fc.weight'", "'model.fc.weight'"]


# --- configs (refused before any weight is read or any array sized)
def _target_cfg(needle, **edits):
    def build(tmp):
        d = write_config(tmp / "t", TARGET_CONFIG, **edits)
        return load_target(d), [str(d / "config.json"), needle]
    return build


def _drafter_cfg(needle, **edits):
    def build(tmp):
        d = write_config(tmp / "d", DRAFTER_CONFIG, **edits)
        return load_drafter(d), [str(d / "config.json"), needle]
    return build


for _name, _build in {
    "config_hidden_size_is_a_string": _target_cfg("'hidden_size' must be an integer", hidden_size="16"),
    "config_num_hidden_layers_is_a_float": _target_cfg("'num_hidden_layers' must be an integer", num_hidden_layers=7.0),
    "config_num_attention_heads_is_a_bool": _target_cfg("'num_attention_heads' must be an integer",
                                                        num_attention_heads=True),
    "config_tie_word_embeddings_is_a_string": _target_cfg("'tie_word_embeddings' must be true or false",
                                                          tie_word_embeddings="false"),
    "config_head_dim_huge": _target_cfg("'head_dim' = 4294967296 is outside", head_dim=2**32),
    "config_head_dim_odd": _target_cfg("head_dim=7 must be even", head_dim=7),
    "config_vocab_size_negative": _target_cfg("'vocab_size' = -5 is outside", vocab_size=-5),
    "config_num_key_value_heads_zero": _target_cfg("'num_key_value_heads' = 0 is outside", num_key_value_heads=0),
    "config_kv_heads_do_not_divide_heads": _target_cfg("num_key_value_heads=3", num_key_value_heads=3),
    "config_rope_theta_zero": _target_cfg("'rope_theta' = 0 must be finite and positive", rope_theta=0),
    "config_rms_norm_eps_is_a_list": _target_cfg("'rms_norm_eps' must be a number", rms_norm_eps=[1e-5]),
    "config_eos_token_id_is_a_string": _target_cfg("'eos_token_id' must be", eos_token_id="</s>"),
    "config_sliding_window_negative": _target_cfg("'sliding_window' = -1 is outside", model_type="mistral",
                                                  sliding_window=-1),
    "config_rope_scaling_is_a_string": _target_cfg("'rope_scaling' must be an object", rope_scaling="llama3"),
    "config_hidden_act_gelu": _target_cfg("hidden_act='gelu' is not supported", hidden_act="gelu"),
    "config_model_type_gpt2": _target_cfg("unknown model_type 'gpt2'", model_type="gpt2"),
    "config_drafter_draft_vocab_over_vocab": _drafter_cfg(
        f"'draft_vocab_size' = {V + 1} is outside [1, vocab_size={V}]", draft_vocab_size=V + 1),
    "config_drafter_target_hidden_size_huge": _drafter_cfg("'target_hidden_size' = 1000000000000 is outside",
                                                           target_hidden_size=10**12),
    "config_drafter_eagle_layer_ids_two": _drafter_cfg("'eagle_config.eagle_aux_hidden_state_layer_ids'=[1, 2]",
                                                       eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]}),
    "config_drafter_eagle_config_is_a_list": _drafter_cfg("'eagle_config' must be an object", eagle_config=[1, 2, 3]),
    "config_drafter_intermediate_size_is_null": _drafter_cfg("missing required key 'intermediate_size'",
                                                             intermediate_size=None),
}.items():
    CASES[_name] = (_build, ValueError)


@case(ValueError)
def config_rms_norm_eps_nan(tmp):
    d = write_config(tmp / "t", TARGET_CONFIG, rms_norm_eps=float("nan"))  # json writes the NaN literal
    assert "NaN" in (d / "config.json").read_text()
    return load_target(d), [str(d / "config.json"), "'rms_norm_eps'", "finite"]


@case(ValueError)
def config_llama3_rope_equal_freq_factors(tmp):
    d = write_config(tmp / "t", TARGET_CONFIG, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0, original_max_position_embeddings=64))
    return load_target(d), [str(d / "config.json"), "high_freq_factor", "low_freq_factor"]


@case(ValueError)
def config_linear_rope_without_factor(tmp):
    d = write_config(tmp / "t", TARGET_CONFIG, rope_parameters=dict(rope_type="linear", rope_theta=10000.0))
    return load_target(d), [str(d / "config.json"), "'rope_parameters.factor'"]


@case(ValueError)
def config_too_shallow_for_default_capture(tmp):
    d = write_config(tmp / "t", TARGET_CONFIG, num_hidden_layers=4)
    return load_target(d), [str(d / "config.json"), "num_hidden_layers=4", "too shallow"]


@case(ValueError)
def config_top_level_array(tmp):
    d = tmp / "t"
    d.mkdir()
    (d / "config.json").write_text("[1, 2]")
    return load_target(d), [str(d / "config.json"), "expected a JSON object, got list"]


@case(ValueError)
def config_not_utf8(tmp):
    d = tmp / "t"
    d.mkdir()
    (d / "config.json").write_bytes(b'{"model_type": "\xff"}')
    return load_target(d), [str(d / "config.json"), "not valid JSON"]


@case(ValueError)
def config_torch_dtype_int8(tmp):
    d = make_target(tmp / "t", config={**TARGET_CONFIG, "torch_dtype": "int8"})
    return load_target(d), [str(d / "config.json"), "'torch_dtype'", "pass dtype="]


# --- arguments
@case(TypeError)
def argument_capture_layers_floats(tmp):
    d = make_target(tmp / "t")
    return load_target(d, capture_layers=(2.0, 3.0, 4.0)), ["capture_layers"]


@case(ValueError)
def argument_capture_layers_past_the_last_layer(tmp):
    d = make_target(tmp / "t")
    return load_target(d, capture_layers=(2, 3, L)), ["capture_layers", f"[0, {L})"]


@case(ValueError)
def argument_dtype_int8(tmp):
    d = make_target(tmp / "t")
    return load_target(d, dtype="int8"), ["dtype='int8'"]


@case(TypeError)
def argument_dtype_not_a_dtype(tmp):
    d = make_target(tmp / "t")
    return load_target(d, dtype=object()), ["dtype="]


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_input_is_refused_clearly(tmp_path, name):
    build, exc = CASES[name]
    call, needles = build(tmp_path)
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


# ------------------------------------------------------------------ good files, bounded costs
@pytest.mark.parametrize("fmt", ["bin", "safetensors", "target_sharded"])
def test_unmutated_checkpoints_load(tmp_path, fmt):
    """The builders write valid checkpoints: every refusal above is the mutation's doing."""
    if fmt == "target_sharded":
        t = eagle3_jax.load_target(make_target(tmp_path / "t", shards=2))
        np.testing.assert_array_equal(t.embed[...], target_tensors()["model.embed_tokens.weight"])
        return
    d = (make_drafter_bin if fmt == "bin" else make_drafter_st)(tmp_path / "d")
    drafter = eagle3_jax.load_drafter(d, embed=EMBED)
    want = drafter_tensors()
    np.testing.assert_array_equal(drafter.fc[...], want["fc.weight"].T)
    np.testing.assert_array_equal(drafter.d2t[...], want["d2t"])


def test_forged_pickle_matches_torch(tmp_path):
    """The hand-written torch format is torch's: torch reads our file, we read torch's."""
    torch = pytest.importorskip("torch")
    tensors = drafter_tensors()
    d = make_drafter_bin(tmp_path / "d")
    ours = torch.load(d / "pytorch_model.bin", weights_only=True)
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, tmp_path / "torch.bin")
    theirs = TorchPickleSource(tmp_path / "torch.bin").tensors
    for name, arr in tensors.items():
        np.testing.assert_array_equal(ours[name].numpy(), arr)
        np.testing.assert_array_equal(theirs[name], arr)


def test_hugging_face_cache_symlinks_load(tmp_path):
    """Shards that are symlinks into a hub cache's ``blobs/`` (as ``huggingface_hub`` lays
    them out) stay allowed: only links leaving the checkpoint (and its cache) are refused."""
    repo = tmp_path / "models--org--tiny"
    snap = make_target(repo / "snapshots" / "abc123", shards=2)
    (repo / "blobs").mkdir()
    for shard in snap.glob("*.safetensors"):
        blob = repo / "blobs" / shard.name.replace("model", "sha")
        shard.rename(blob)
        os.symlink(os.path.relpath(blob, snap), shard)
    target = eagle3_jax.load_target(snap)
    np.testing.assert_array_equal(target.norm[...], target_tensors()["model.norm.weight"])


def _refused_within(call, seconds: float, mib: int):
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ValueError) as info:
            call()
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < seconds, f"took {elapsed:.1f}s"
    assert peak < mib << 20, f"peak {peak / 2**20:.0f} MiB"
    return info.value


@pytest.mark.parametrize("name", ["zip_bomb_entry_larger_than_declared", "zip_bomb_entry_declared_by_the_pickle",
                                  "zip_bomb_header_lies", "pickle_1e9_floats_viewed_in_4_byte_storage",
                                  "pickle_4_byte_storage_declared_as_4096_floats"])
def test_bombs_and_out_of_bounds_refused_fast_in_bounded_memory(tmp_path, name):
    """A 2 MB file holding a deflated 2 GiB entry, and tensors larger than their storage:
    refused in under 2 s with under 16 MiB of Python/numpy allocations (tracemalloc peak)."""
    CASES[name][0](tmp_path)
    file = tmp_path / "d" / "pytorch_model.bin"
    assert file.stat().st_size < 3 << 20
    _refused_within(lambda: TorchPickleSource(file), seconds=2.0, mib=16)


def test_huge_head_dim_refused_before_allocating(tmp_path):
    """head_dim = 2**32 would size a 16 GiB RoPE table; the config check comes first."""
    call, _ = CASES["config_head_dim_huge"][0](tmp_path)
    _refused_within(call, seconds=2.0, mib=16)


def test_unreferenced_bomb_entry_is_never_read(tmp_path):
    """Only the entries the pickle references are read: a 2 GiB bomb beside them costs nothing."""
    bomb = Entry("archive/data/unused", deflated_zeros(2048), zipfile.ZIP_DEFLATED, file_size=2 << 30, crc=0)
    d = make_drafter_bin(tmp_path / "d", entries=lambda es: es + [bomb])
    tracemalloc.start()
    try:
        start = time.perf_counter()
        tensors = TorchPickleSource(d / "pytorch_model.bin").tensors
        elapsed, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 2.0 and peak < 16 << 20, (elapsed, peak)
    np.testing.assert_array_equal(tensors["fc.weight"], drafter_tensors()["fc.weight"])


def test_huge_memo_index_does_not_allocate(tmp_path):
    """A memo index of 2**31 - 1 (which makes the C unpickler size its memo to 32 GiB) is a
    dict key to the pure-Python unpickler the reader runs."""
    spec = TensorSpec("norm.weight", "0", "FloatStorage", H, 0, (H,), (1,))
    pkl = one_tensor_pickle(spec)
    pkl = pkl[:-2] + b"r\xff\xff\xff\x7f" + pkl[-2:]  # LONG_BINPUT 2**31 - 1 on the tensor
    blob = drafter_tensors()["norm.weight"]
    file = tmp_path / "pytorch_model.bin"
    write_zip(file, torch_entries(pkl, {"0": blob.tobytes()}))
    tracemalloc.start()
    try:
        tensors = TorchPickleSource(file).tensors
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20
    np.testing.assert_array_equal(tensors["norm.weight"], blob)
