"""The torch reader (``eagle3_jax.checkpoint.torch_reader``) on hostile input: a pickle that
calls a global is refused, and fuzzing the checkpoint readers (bounded for CI;
``scripts/fuzz_checkpoints.py`` runs more).

Mutated torch pickles (fields given any value, bytes flipped, inserted, deleted; zip headers
flipped) and mutated configs must each either load correctly (the values an independent
oracle computes) or be refused with a ``ValueError`` naming the file (and the tensor or key):
never a crash, another exception type, or bytes from outside a storage.
"""

import pickle
import shutil
import zipfile

import pytest
from hypothesis import HealthCheck, example, given, settings

import eagle3_jax
from checkpoint_forge import check_config, check_fields, check_pickle_bytes, check_zip_bytes, strategies
from helpers import FIXTURES

FIELDS, PICKLES, FLIPS, CONFIGS = strategies()
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@pytest.fixture(scope="module")
def file(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "pytorch_model.bin"


@FUZZ
@given(edits=FIELDS)
# a storage key that is not ASCII: its zip entry's name is the key's UTF-8, as torch writes and reads it
@example(edits=[(7, "key", "\x80"), (7, "blob", b"")])
def test_mutated_tensor_fields(file, edits):
    check_fields(file, edits)


@FUZZ
@given(pkl=PICKLES)
def test_mutated_pickle_bytes(file, pkl):
    check_pickle_bytes(file, pkl)


@FUZZ
@given(flips=FLIPS)
def test_mutated_zip_bytes(file, flips):
    check_zip_bytes(file, flips)


@settings(max_examples=100, deadline=None, database=None)
@given(case=CONFIGS)
def test_mutated_configs(case):
    check_config(*case)


def test_malicious_pickle_is_refused(tmp_path):
    d = tmp_path / "d"
    shutil.copytree(FIXTURES / "drafter_tiny", d)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with zipfile.ZipFile(d / "pytorch_model.bin", "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"x": Evil()}))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load global builtins.print"):
        eagle3_jax.checkpoint.TorchPickleSource(d / "pytorch_model.bin")
