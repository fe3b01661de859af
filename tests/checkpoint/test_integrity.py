"""Damaged model checkpoints: a flipped byte or a truncated data file never loads wrong values.

Every data file of an MXFP4 checkpoint is damaged at several positions (one at a time, on a
copy); ``load_model`` must then either raise :class:`CheckpointError` naming the checkpoint and
an array, or return the saved bits exactly (bytes Orbax never reads, e.g. a superseded b-tree
node). ``jaxmoe logits`` reports the same error and exits 1.
"""

import dataclasses
import pathlib
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from jaxmoe import cli
from jaxmoe.checkpoint import integrity
from jaxmoe.checkpoint.io import load_model, save_model, write_checkpoint
from jaxmoe.config import from_config_dict, load_config_dict
from jaxmoe.errors import CheckpointError
from jaxmoe.model import abstract_model
from jaxmoe.quant import quantize_state

ROOT = pathlib.Path(__file__).parent.parent.parent
POSITIONS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.8, 1.0)  # fraction of the file; 1.0 is the last byte


def _cfg():
    cd = load_config_dict(ROOT / "configs/tiny.py")
    cd.model.moe.expert_ffw_dim = 64
    cd.model.mxfp4_weights = ("w_gate", "w_up", "w_down")
    return from_config_dict(cd)


def _random_state(cfg, seed=0):
    """An MXFP4 model state of random values (cheaper than the eager model init)."""
    rng = np.random.default_rng(seed)
    abstract = nnx.to_pure_dict(nnx.state(abstract_model(dataclasses.replace(cfg.model, mxfp4_weights=()))))
    host = jax.tree.map(lambda a: (0.05 * rng.standard_normal(a.shape)).astype(a.dtype), abstract)
    return jax.tree.map(np.asarray, quantize_state(host, cfg.model))


def _leaves(state):
    for kp, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        yield tuple(k.key for k in kp), leaf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = _cfg()
    state = _random_state(cfg)
    path = write_checkpoint(tmp_path_factory.mktemp("integrity") / "ckpt", cfg, _leaves(state))
    return cfg, state, path


def _data_files(ckpt: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in (ckpt / "params").rglob("d/*") if p.is_file())


def _loads_exactly_or_names_array(ckpt, state) -> bool:
    """True if loading raised a proper error, False if it returned the saved bits; fails otherwise."""
    try:
        _, model = load_model(ckpt)
    except CheckpointError as e:
        msg = str(e)
        assert str(ckpt) in msg, msg
        names = re.findall(r"array '([^']+)'", msg)
        assert names, msg
        known = {integrity.path_str(p) for p, _ in _leaves(state)}
        assert set(names) <= known, msg
        return True
    got = nnx.to_pure_dict(nnx.state(model))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), got, state)
    return False


def test_clean_checkpoint_loads_bit_identical(saved):
    cfg, state, path = saved
    cfg2, model = load_model(path)
    assert cfg2 == cfg
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), nnx.to_pure_dict(nnx.state(model)), state
    )


def test_flipped_bytes_never_load_wrong_values(saved, tmp_path):
    _, state, path = saved
    files = _data_files(path)
    assert len(files) >= 3
    errors = {}
    for i, rel in enumerate(f.relative_to(path) for f in files):
        for frac in POSITIONS:
            copy = tmp_path / f"c{i}_{frac}"
            shutil.copytree(path, copy)
            raw = bytearray((copy / rel).read_bytes())
            pos = min(int(frac * len(raw)), len(raw) - 1)
            raw[pos] ^= 0x04
            (copy / rel).write_bytes(bytes(raw))
            errors[(rel.name, frac)] = _loads_exactly_or_names_array(copy, state)
            shutil.rmtree(copy)
    largest = max(files, key=lambda f: f.stat().st_size).name
    # The bulk of the largest data file is array chunks: a flip there must be caught.
    assert all(errors[(largest, f)] for f in (0.2, 0.4, 0.5, 0.6, 0.8)), errors


def test_checksum_catches_what_orbax_misses(saved, tmp_path):
    """Find a flip that Orbax restores silently as other values; the checksum must reject it."""
    _, state, path = saved
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    largest = max(_data_files(path), key=lambda f: f.stat().st_size).relative_to(path)
    copy = tmp_path / "c"
    shutil.copytree(path, copy)
    original = (copy / largest).read_bytes()
    for frac in (0.3, 0.5, 0.7, 0.45, 0.55):
        raw = bytearray(original)
        raw[int(frac * len(raw))] ^= 0x04
        (copy / largest).write_bytes(bytes(raw))
        try:
            silent = integrity._raw_restore(integrity.pytree_dir(copy / "params"), target)
        except Exception:  # noqa: BLE001 (this flip Orbax noticed; try another)
            continue
        differs = [
            p
            for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(silent)[0], jax.tree.leaves(state))
            if not np.array_equal(a, b)
        ]
        if differs:
            with pytest.raises(CheckpointError, match="is corrupt: digest64"):
                load_model(copy)
            return
    pytest.fail("every flip was caught by Orbax itself; the silent case was not exercised")


def test_truncated_data_files(saved, tmp_path):
    _, state, path = saved
    caught = {}
    for i, rel in enumerate(f.relative_to(path) for f in _data_files(path)):
        copy = tmp_path / f"t{i}"
        shutil.copytree(path, copy)
        raw = (copy / rel).read_bytes()
        (copy / rel).write_bytes(raw[: len(raw) // 2])
        caught[rel.name] = _loads_exactly_or_names_array(copy, state)
        shutil.rmtree(copy)
    largest = max(_data_files(path), key=lambda f: f.stat().st_size).name
    assert caught[largest], caught


def test_logits_cli_reports_corruption(saved, tmp_path, capsys):
    _, _, path = saved
    copy = tmp_path / "c"
    shutil.copytree(path, copy)
    largest = max(_data_files(copy), key=lambda f: f.stat().st_size)
    raw = bytearray(largest.read_bytes())
    raw[len(raw) // 2] ^= 0x80
    largest.write_bytes(bytes(raw))
    np.save(tmp_path / "tokens.npy", np.zeros((1, 5), np.int32))
    rc = cli.main(["logits", "--checkpoint", str(copy), "--tokens", str(tmp_path / "tokens.npy"), "--out", "x.npy"])
    err = capsys.readouterr().err
    assert rc == 1
    assert str(copy) in err and re.search(r"array '[^']+'", err), err
    assert not (tmp_path / "x.npy").exists()


def test_missing_or_damaged_checksums(saved, tmp_path):
    _, _, path = saved
    copy = tmp_path / "c"
    shutil.copytree(path, copy)
    (copy / "checksums.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="checksums.json is damaged"):
        load_model(copy)
    (copy / "checksums.json").unlink()
    with pytest.raises(CheckpointError, match="has no checksums.json"):
        load_model(copy)


def test_save_model_is_atomic(saved, tmp_path):
    """A failing writer leaves neither the destination nor its staging directory."""
    cfg, state, _ = saved

    def leaves():
        yield from list(_leaves(state))[:3]
        raise RuntimeError("writer killed")

    with pytest.raises(RuntimeError, match="writer killed"):
        write_checkpoint(tmp_path / "ckpt", cfg, leaves())
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileExistsError, match="already exists"):
        save_model(nnx.merge(*nnx.split(abstract_model(cfg.model))), cfg, saved[2])
