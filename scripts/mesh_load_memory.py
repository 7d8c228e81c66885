"""Peak host memory of loading a target onto a device mesh (``load_target(path, mesh=...)``).

Writes a synthetic Llama checkpoint of about 2.2 GB (float32, 32 layers in 5 safetensors
shards with an index; largest single tensor: the 131 MB embedding / lm_head) to a temporary
directory, then loads it in a fresh subprocess on 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) for each ``--mesh``, and reports:

* baseline: the process's RSS just before the load (Python, JAX, the mesh);
* resident: the bytes of every device buffer the loaded model holds (on simulated CPU
  devices, device memory is host memory, so these are part of the RSS);
* peak: the process's RSS high-water mark (VmHWM) after the load;
* transient = peak - baseline - resident: what the load held beyond its result (in-flight
  blocks, and what the runtime keeps: compiled programs, allocator caches; the final RSS
  is printed too).

The load passes when ``transient <= 2 x largest single tensor``.  ``--compare`` also
measures the loader without a mesh followed by ``jax.device_put`` onto the same shardings
(everything first gathered on one device, as before per-device loading existed).

    python scripts/mesh_load_memory.py [--mesh fsdp=2,tensor=4 --mesh tensor=8] [--compare] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=1024, intermediate_size=4096,
              num_hidden_layers=32, num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=32000,
              max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
              torch_dtype="float32")


def write_checkpoint(directory: Path) -> dict:
    """The synthetic checkpoint (HF names, PyTorch [out, in] layout), sharded by layer groups."""
    from safetensors.numpy import save_file

    c = CONFIG
    H, I, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    NQ, NK = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    rng = np.random.default_rng(0)
    w = lambda *shape: (0.02 * rng.standard_normal(shape, dtype=np.float32))
    groups = [{"model.embed_tokens.weight": lambda: w(V, H)}]
    for start in range(0, L, 8):
        group = {}
        for i in range(start, min(start + 8, L)):
            p = f"model.layers.{i}."
            group.update({p + "self_attn.q_proj.weight": (NQ, H), p + "self_attn.k_proj.weight": (NK, H),
                          p + "self_attn.v_proj.weight": (NK, H), p + "self_attn.o_proj.weight": (H, NQ),
                          p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                          p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                          p + "post_attention_layernorm.weight": (H,)})
        groups.append({k: (lambda s=s: w(*s)) for k, s in group.items()})
    groups[-1].update({"model.norm.weight": lambda: np.ones(H, np.float32), "lm_head.weight": lambda: w(V, H)})
    weight_map, total, largest = {}, 0, 0
    for n, group in enumerate(groups):
        file = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        arrays = {k: make() for k, make in group.items()}
        save_file(arrays, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(arrays, file))
        total += sum(a.nbytes for a in arrays.values())
        largest = max(largest, max(a.nbytes for a in arrays.values()))
        del arrays
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return {"checkpoint_bytes": total, "largest_tensor_bytes": largest, "tensors": len(weight_map)}


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def child(path: str, mesh_text: str, mode: str):
    """Runs in the subprocess: one load, its memory as JSON on stdout."""
    import time

    import jax
    from flax import nnx

    import eagle3_jax
    from eagle3_jax.models.target import declare
    from eagle3_jax.sharding import make_mesh, parse_mesh

    mesh = make_mesh(**parse_mesh(mesh_text))
    before = _status()
    t0 = time.perf_counter()
    if mode == "mesh":
        model = eagle3_jax.load_target(path, mesh=mesh)
    else:  # the whole model on one device, then placed on the shardings
        model = eagle3_jax.load_target(path)
        shardings = declare(model.config).shardings(mesh)
        for name, sharding in shardings.items():
            getattr(model, name).set_value(jax.device_put(getattr(model, name)[...], sharding))
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - t0
    after = _status()
    leaves = [x for x in jax.tree.leaves(nnx.state(model)) if isinstance(x, jax.Array)]
    resident = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    wq = model.wq[...]
    print(json.dumps({"before": before, "after": after, "resident_bytes": resident, "seconds": seconds,
                      "wq_shard_shape": list(wq.addressable_shards[0].data.shape), "wq_shape": list(wq.shape),
                      "devices": len(jax.devices())}))


def measure(path: Path, mesh_text: str, mode: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, __file__, "--child", str(path), "--mode", mode, "--mesh", mesh_text],
                         capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"load on mesh {mesh_text} ({mode}) failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", action="append", help="mesh axes, e.g. fsdp=2,tensor=4 (repeatable; 8 devices)")
    ap.add_argument("--compare", action="store_true", help="also measure load-then-device_put")
    ap.add_argument("--dir", type=Path, help="where to write the checkpoint (default: a temporary directory, removed)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="mesh", help=argparse.SUPPRESS)
    args = ap.parse_args()
    meshes = args.mesh or ["fsdp=2,tensor=4", "tensor=8"]
    if args.child:
        return child(args.child, meshes[0], args.mode)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp)
        info = write_checkpoint(path)
        mb = lambda b: f"{b / 1e6:,.0f} MB"
        print(f"checkpoint: {mb(info['checkpoint_bytes'])} in {info['tensors']} tensors, largest tensor "
              f"{mb(info['largest_tensor_bytes'])}; bound on the transient: 2 x largest = "
              f"{mb(2 * info['largest_tensor_bytes'])}")
        ok = True
        for mesh_text in meshes:
            for mode in ("mesh", "device_put") if args.compare else ("mesh",):
                r = measure(path, mesh_text, mode)
                baseline, peak = r["before"]["VmRSS"], r["after"]["VmHWM"]
                transient = peak - baseline - r["resident_bytes"]
                passed = transient <= 2 * info["largest_tensor_bytes"]
                ok &= passed or mode != "mesh"
                print(f"mesh {mesh_text:16s} {mode:10s} baseline {mb(baseline)}, resident {mb(r['resident_bytes'])}, "
                      f"peak {mb(peak)} (final RSS {mb(r['after']['VmRSS'])}) -> transient {mb(transient)} "
                      f"({transient / info['largest_tensor_bytes']:.2f} x largest tensor) "
                      f"{'within' if passed else 'OVER'} the bound; wq {r['wq_shape']} per device "
                      f"{r['wq_shard_shape']}; {r['seconds']:.1f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
