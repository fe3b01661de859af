"""Kimi K2.5 image input against HF transformers' ``kimi_k25`` (torch, fp32).

A tiny random ``Kimi_K25ForConditionalGeneration`` (every weight and norm random, a 6 x 6
position table resampled up and down to the images' grids) is saved with ``save_pretrained``
and imported; HF's own ``pixel_values`` and ``image_grid_thw`` are fed to both. The tower's
patch features and the projected tokens match to 1e-5, the logits of sequences with one and with
two images of different sizes to 1e-4; the tower sharded on 8-device meshes equals one device.
"""

import json

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from jaxmoe import cli
from jaxmoe.checkpoint.hf_import import import_hf
from jaxmoe.config import ConfigError, MeshConfig
from jaxmoe.model import shard_model
from jaxmoe.sharding import make_mesh
from jaxmoe.vision import image_grids, merged_tokens, vision_inputs

IMAGE, START, END = 90, 92, 93
GRIDS = {"one": [(1, 4, 6)], "two": [(1, 6, 8), (1, 4, 4)]}


def _hf_model(seed=0):
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration  # noqa: PLC0415

    torch.manual_seed(seed)
    text = dict(
        model_type="deepseek_v3", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_group=2, topk_group=1,
        max_position_embeddings=256,
    )  # fmt: skip
    vision = dict(
        patch_size=4, pos_emb_height=6, pos_emb_width=6, num_attention_heads=2, num_hidden_layers=2, hidden_size=24,
        intermediate_size=40, rope_parameters=dict(rope_type="axial", rope_theta=10000.0),
    )  # fmt: skip
    cfg = Kimi_K25Config(
        text_config=text, vision_config=vision, projection_hidden_size=24, image_token_id=IMAGE,
        video_token_id=91, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    model = Kimi_K25ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (
                name.endswith("norm.weight")
                or "layernorm.weight" in name
                or "norm1.weight" in name
                or ("norm2.weight" in name)
            ):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def _inputs(grids, seed):
    rng = np.random.default_rng(seed)
    patches = sum(h * w for _, h, w in grids)
    pixels = rng.normal(size=(patches, 3, 4, 4)).astype(np.float32)
    ids = [int(x) for x in rng.integers(0, 90, 3)]
    for _, h, w in grids:
        ids += [START] + [IMAGE] * ((h // 2) * (w // 2)) + [END] + [int(x) for x in rng.integers(0, 90, 4)]
    return np.array([ids], np.int32), pixels, np.array(grids, np.int64)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    hf = _hf_model()
    folder = tmp_path_factory.mktemp("k25") / "hf"
    hf.save_pretrained(folder)
    cfg, model = import_hf(folder)
    return hf, folder, cfg, model


def test_the_saved_layout_is_moonshots(imported):
    _, folder, cfg, _ = imported
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(folder / "model.safetensors", "numpy") as f:
        keys = set(f.keys())
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in keys and "mm_projector.proj.0.weight" in keys
    assert "language_model.model.blocks.1.mlp.experts.0.gate_proj.weight" in keys
    assert cfg.model.tie_embeddings and cfg.model.vision.image_token_id == IMAGE


@pytest.mark.parametrize("images", sorted(GRIDS))
def test_tower_matches_hf(imported, images):
    hf, _, cfg, model = imported
    _, pixels, grid = _inputs(GRIDS[images], seed=1)
    with torch.no_grad():
        out = hf.model.vision_tower(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grid))
        want_patches = out.last_hidden_state.numpy()
        features = hf.model.get_image_features(torch.from_numpy(pixels), torch.from_numpy(grid))
        want_tokens = torch.cat(features.pooler_output)
    inputs = vision_inputs(pixels, image_grids(grid, cfg.model.vision), cfg.model.vision)
    got_patches = np.asarray(jax.jit(lambda t, x: t.encode(x))(model.vision, inputs))
    got_tokens = np.asarray(jax.jit(lambda t, x: t(x))(model.vision, inputs))
    np.testing.assert_allclose(got_patches, want_patches, atol=1e-5, rtol=0)
    assert got_tokens.shape == (merged_tokens(image_grids(grid, cfg.model.vision), cfg.model.vision), 32)
    np.testing.assert_allclose(got_tokens, want_tokens.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("images", sorted(GRIDS))
def test_logits_match_hf_through_the_cli(imported, images, tmp_path):
    hf, folder, _, _ = imported
    tokens, pixels, grid = _inputs(GRIDS[images], seed=2)
    with torch.no_grad():
        want = hf(
            input_ids=torch.from_numpy(tokens).long(),
            pixel_values=torch.from_numpy(pixels),
            image_grid_thw=torch.from_numpy(grid),
        ).logits.numpy()
    assert cli.main(["convert", "hf", str(folder), str(tmp_path / "jm"), "--no-progress"]) == 0
    for name, array in (("tokens", tokens), ("pv", pixels), ("grid", grid)):
        np.save(tmp_path / f"{name}.npy", array)
    argv = ["logits", "--checkpoint", str(tmp_path / "jm"), "--tokens", str(tmp_path / "tokens.npy")]
    argv += ["--pixel-values", str(tmp_path / "pv.npy"), "--image-grid", str(tmp_path / "grid.npy")]
    assert cli.main([*argv, "--out", str(tmp_path / "out.npy")]) == 0
    got = np.load(tmp_path / "out.npy")
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_logits_cli_refuses_mismatched_images(imported, tmp_path):
    _, folder, _, _ = imported
    tokens, pixels, grid = _inputs(GRIDS["one"], seed=3)
    assert cli.main(["convert", "hf", str(folder), str(tmp_path / "jm"), "--no-progress"]) == 0
    np.save(tmp_path / "tokens.npy", np.delete(tokens, np.flatnonzero(tokens[0] == IMAGE)[0], axis=1))  # one short
    np.save(tmp_path / "pv.npy", pixels)
    np.save(tmp_path / "grid.npy", grid)
    argv = ["logits", "--checkpoint", str(tmp_path / "jm"), "--tokens", str(tmp_path / "tokens.npy"),
            "--pixel-values", str(tmp_path / "pv.npy"), "--image-grid", str(tmp_path / "grid.npy"),
            "--out", str(tmp_path / "out.npy")]  # fmt: skip
    with pytest.raises(SystemExit, match="placeholder"):
        cli.main(argv)
    np.save(tmp_path / "grid.npy", np.array([[1, 4, 5]]))
    np.save(tmp_path / "tokens.npy", tokens)
    with pytest.raises(SystemExit, match="merge block"):
        cli.main(argv)


@pytest.mark.parametrize("mesh", [MeshConfig(fsdp=4, tensor=2), MeshConfig(data=2, fsdp=2, tensor=2)])
def test_tower_sharded_equals_one_device(imported, mesh):
    _, _, cfg, model = imported
    _, pixels, grid = _inputs(GRIDS["two"], seed=4)
    inputs = vision_inputs(pixels, image_grids(grid, cfg.model.vision), cfg.model.vision)
    fn = jax.jit(lambda t, x: t(x))
    want = np.asarray(fn(model.vision, inputs))
    devices = make_mesh(mesh)
    with jax.set_mesh(devices):
        sharded = shard_model(nnx.clone(model.vision), devices)  # the tiny vocab (97) does not split
        specs = {str(v.get_value().sharding.spec) for _, v in nnx.iter_graph(sharded) if isinstance(v, nnx.Param)}
        assert any("tensor" in s for s in specs) and any("fsdp" in s for s in specs)
        got = np.asarray(fn(sharded, inputs))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_unsupported_configs_are_refused(tmp_path):
    from jaxmoe.checkpoint.hf_import import config_from_hf  # noqa: PLC0415

    hf = json.loads(json.dumps(_hf_model().config.to_dict()))
    config_from_hf(hf)
    bad = json.loads(json.dumps(hf))
    bad["vision_config"]["hidden_act"] = "relu"
    with pytest.raises(ConfigError, match="hidden_act"):
        config_from_hf(bad)
    bad = json.loads(json.dumps(hf))
    bad["projection_hidden_size"] = 48
    with pytest.raises(ConfigError, match="projection_hidden_size"):
        config_from_hf(bad)
    bad = json.loads(json.dumps(hf))
    bad["image_token_id"] = 500
    with pytest.raises(ConfigError, match="model.vision.image_token_id"):
        config_from_hf(bad)
