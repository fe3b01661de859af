"""``jaxmoe generate``: text or request files through the inference engine.

``--checkpoint`` may be a training workdir (its newest checkpoint and its tokenizer), a
training checkpoint root (``workdir/checkpoints``), or a model checkpoint such as the MXFP4
export or an HF conversion (``config.json`` + ``params/``; a tokenizer folder's files,
``tokenizer.json`` and ``tokenizer_config.json``, beside it or in its parent directory if it has
one). Each may be local or in a bucket (``gs://B/P``), read where it lies.

``--requests IN.jsonl --out OUT.jsonl`` runs every request of the file together through one
engine. An input line is ``{"prompt_ids": [...]}`` or ``{"prompt": "text"}`` (text needs a
tokenizer) with optional ``max_tokens`` (64), ``temperature`` (0: greedy), ``top_p``, ``top_k``,
``seed``, ``stop`` (a string or a list of them) and ``ignore_eos``; output lines, in input order,
are ``{"output_ids", "text", "finish_reason", "logprobs"}``. A text prompt gets the eos id in front,
as every training document follows one.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence

import jax
from flax import nnx
from tqdm import tqdm

from jaxmoe.chat.decoding import MarkupIds
from jaxmoe.chat.format import markup_for
from jaxmoe.chat.template import render
from jaxmoe.chat.tokenizer import Tokenizer
from jaxmoe.checkpoint.io import CONFIG_FILE, load_model
from jaxmoe.config import Config, MeshConfig
from jaxmoe.errors import CheckpointError
from jaxmoe.inference.engine import Engine, EngineConfig, place
from jaxmoe.inference.sampler import SamplingParams
from jaxmoe.inference.scheduler import Images, Request
from jaxmoe.model import abstract_model
from jaxmoe.paths import resolve
from jaxmoe.rules import MESH_AXES
from jaxmoe.sharding import make_mesh
from jaxmoe.train.checkpoints import CHECKPOINT_DIR, TOKENIZER_FILE, restore_model
from jaxmoe.vision.layout import merged_tokens
from jaxmoe.vision.preprocess import ImageError, preprocess

REQUEST_FIELDS = ("prompt_ids", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


def _inference_config(cfg: Config) -> Config:
    """The engine's dispatch: dropless (a capacity limit would let padding take capacity); one device."""
    moe = dataclasses.replace(cfg.model.moe, dispatch="dropless")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe), mesh=MeshConfig())


def _with_config(model: nnx.Module, cfg: Config) -> nnx.Module:
    """The same weights in a model built for ``cfg`` (the inference dispatch)."""
    _, state = nnx.split(model)
    graphdef, _ = nnx.split(abstract_model(cfg.model))
    return nnx.merge(graphdef, state)


def _tokenizer(path, cfg: Config) -> Tokenizer | None:
    for where in (path, path.parent):
        if (where / TOKENIZER_FILE).is_file():
            try:
                tokenizer = Tokenizer.load(where)
            except ValueError as e:
                raise CheckpointError(f"the checkpoint's tokenizer cannot be read: {e}") from e
            if tokenizer.vocab_size > cfg.model.vocab_size:
                raise CheckpointError(
                    f"{where / TOKENIZER_FILE} has {tokenizer.vocab_size} tokens, the model's vocab_size is "
                    f"{cfg.model.vocab_size}"
                )
            return tokenizer
    return None


def load_for_generation(
    path: str | pathlib.Path, mesh: jax.sharding.Mesh | None = None
) -> tuple[Config, nnx.Module, Tokenizer | None]:
    """``(config, model, tokenizer or None)`` from a workdir, checkpoint root or model checkpoint.

    The weights land on this process's first device, or sharded over ``mesh`` by the rules (a
    global mesh in a multi-process run: every process restores its own shards).
    """
    path = resolve(path)
    if not path.is_dir():
        raise FileNotFoundError(f"--checkpoint {str(path)!r} is not a directory")
    if (path / CHECKPOINT_DIR).is_dir():
        cfg, model = restore_model(path / CHECKPOINT_DIR)
    elif (path / CONFIG_FILE).is_file():
        cfg, model = load_model(path, mesh)  # read where it lies, a bucket's too
    elif any(p.name.isdigit() for p in path.iterdir()):
        cfg, model = restore_model(path)
    else:
        raise FileNotFoundError(
            f"--checkpoint {str(path)!r} is neither a training workdir (with {CHECKPOINT_DIR}/), a checkpoint "
            f"root (numbered steps) nor a model checkpoint (with {CONFIG_FILE})"
        )
    if mesh is not None and not (path / CONFIG_FILE).is_file():
        model = place(model, mesh)  # a training checkpoint restores onto one device first
    tokenizer = _tokenizer(path, cfg)
    cfg = _inference_config(cfg)
    return cfg, _with_config(model, cfg), tokenizer


def _engine(model, tokenizer: Tokenizer | None, config: EngineConfig | None, mesh=None) -> Engine:
    eos = tokenizer.eos_id if tokenizer is not None else None
    detokenize = tokenizer.decode if tokenizer is not None else None
    return Engine(model, config or EngineConfig(), eos_id=eos, detokenize=detokenize, mesh=mesh)


def generate(
    path: str | pathlib.Path,
    prompt: str,
    *,
    images: Sequence[str | pathlib.Path] = (),
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    engine_config: EngineConfig | None = None,
) -> dict:
    """Loads ``path`` and continues ``prompt``: ``{"prompt", "completion", "tokens", "text", "finish_reason"}``.

    With ``images`` (files; a checkpoint with a vision tower) the prompt is a user turn instead, the
    images first, then the text, rendered by the chat template without thinking; the completion is
    the assistant's answer, up to the end of its turn, and ``text`` is that answer.

    Raises:
      RequestError: images for a model without a vision tower, or an image that cannot be used.
    """
    cfg, model, tokenizer = load_for_generation(path)
    if tokenizer is None:
        raise FileNotFoundError(
            f"no {TOKENIZER_FILE} in {str(path)!r} or its parent: --prompt needs one (use --requests with prompt_ids)"
        )
    sampling = SamplingParams(temperature=temperature, seed=seed)
    if images:
        request = _image_request(cfg, tokenizer, prompt, images, max_new_tokens, sampling)
    else:
        request = Request((tokenizer.eos_id, *tokenizer.encode(prompt)), max_tokens=max_new_tokens, sampling=sampling)
    out = _engine(model, tokenizer, engine_config).generate([request])[0]
    completion = out.text
    return {
        "prompt": prompt,
        "completion": completion,
        "tokens": out.output_ids,
        "text": completion if images else prompt + completion,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "image_tokens": out.image_tokens,
    }


def _image_request(cfg: Config, tokenizer: Tokenizer, prompt: str, files, max_tokens: int, sampling) -> Request:
    """A chat turn of ``files`` (images) then ``prompt``, ending at the end of the answer's turn."""
    vision = cfg.model.vision
    if vision is None:
        raise RequestError("--image: this checkpoint's model has no vision tower (model.vision is not set)")
    data = []
    for f in files:
        try:
            data.append(pathlib.Path(f).read_bytes())
        except OSError as e:
            raise RequestError(f"--image {str(f)!r}: {e.strerror or e}") from None
    try:
        pixel_values, grid = preprocess(data, vision)
    except ImageError as e:
        names = {f"image {i}": f"--image {str(f)!r}" for i, f in enumerate(files)}
        message = str(e)
        for name, flag in names.items():
            message = message.replace(f"{name}:", f"{flag}:")
        raise RequestError(message) from None
    content = [{"type": "image", "tokens": merged_tokens([(int(h), int(w))], vision)} for _, h, w in grid]
    content.append({"type": "text", "text": prompt})
    try:
        ids = render([{"role": "user", "content": content}], tokenizer, thinking=False,
                     image_token_id=vision.image_token_id)  # fmt: skip
    except ValueError as e:
        raise RequestError(f"--image: {e}") from None
    ends = MarkupIds.from_tokenizer(tokenizer, markup_for(tokenizer)).end_ids
    return Request(
        tuple(ids), max_tokens=max_tokens, sampling=sampling, stop_ids=ends, images=Images(pixel_values, grid)
    )


class RequestError(ValueError):
    """A request line holds a field that is not allowed; the message names the line and field."""


def parse_request(line: dict, tokenizer: Tokenizer | None, where: str) -> Request:
    """One ``--requests`` line to a :class:`Request`, refusing unknown or ill-typed fields."""
    if not isinstance(line, dict):
        raise RequestError(f"{where}: a request is a JSON object, got {type(line).__name__}")
    unknown = sorted(set(line) - set(REQUEST_FIELDS))
    if unknown:
        raise RequestError(f"{where}: unknown field {unknown[0]!r}; allowed: {REQUEST_FIELDS}")
    if ("prompt_ids" in line) == ("prompt" in line):
        raise RequestError(f"{where}: give exactly one of 'prompt_ids' (token ids) or 'prompt' (text)")
    if "prompt" in line:
        if tokenizer is None:
            raise RequestError(f"{where}: 'prompt' needs a tokenizer; this checkpoint has none, give 'prompt_ids'")
        if not isinstance(line["prompt"], str):
            raise RequestError(f"{where}: 'prompt' must be a string")
        ids = (tokenizer.eos_id, *tokenizer.encode(line["prompt"]))
    else:
        ids = line["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise RequestError(f"{where}: 'prompt_ids' must be a list of integers")
    stop = line.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"{where}: 'stop' must be a non-empty string or a list of them")
    try:
        sampling = SamplingParams(
            temperature=float(line.get("temperature", 0.0)),
            top_p=float(line.get("top_p", 1.0)),
            top_k=_int(line, "top_k", 0, where),
            seed=_int(line, "seed", 0, where),
        )
    except (TypeError, ValueError) as e:
        raise RequestError(f"{where}: {e}") from e
    ignore_eos = line.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError(f"{where}: 'ignore_eos' must be true or false")
    return Request(
        tuple(ids),
        max_tokens=_int(line, "max_tokens", 64, where),
        sampling=sampling,
        stop=tuple(stop),
        ignore_eos=ignore_eos,
    )


def _int(line: dict, key: str, default: int, where: str) -> int:
    value = line.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{where}: {key!r} must be an integer, got {value!r}")
    return value


def parse_mesh(text: str) -> MeshConfig:
    """``"tensor=4,expert=2"`` -> MeshConfig (unnamed axes 1); the product must be the device count."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in MESH_AXES or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh: {part!r} is not AXIS=N with AXIS one of {MESH_AXES} and N >= 1")
        sizes[name] = int(value)
    mesh = MeshConfig(**sizes)
    if mesh.num_devices != jax.device_count():
        raise ValueError(f"--mesh {text!r} has {mesh.num_devices} devices; this run has {jax.device_count()}")
    return mesh


def _read_requests(path: pathlib.Path, tokenizer: Tokenizer | None) -> list[Request]:
    requests = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        where = f"{path}:{n}"
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise RequestError(f"{where}: not JSON: {e}") from e
        requests.append(parse_request(line, tokenizer, where))
    return requests


def run_requests(
    checkpoint: str | pathlib.Path,
    requests_path: str | pathlib.Path,
    out_path: str | pathlib.Path,
    *,
    engine_config: EngineConfig | None = None,
    mesh: MeshConfig | None = None,
    progress: bool = True,
) -> int:
    """Every request of ``requests_path`` through one engine; writes ``out_path``; returns the count.

    With ``mesh`` the weights are sharded over it. In a multi-process run every process calls
    this: process 0 reads the requests, schedules and writes the results; the others follow
    its steps (and return 0).
    """
    mesh_ = make_mesh(mesh) if mesh is not None and mesh.num_devices > 1 else None
    _, model, tokenizer = load_for_generation(checkpoint, mesh_)
    engine = _engine(model, tokenizer, engine_config, mesh_)
    if jax.process_index() != 0:
        engine.follow()
        return 0
    try:
        requests = _read_requests(pathlib.Path(requests_path), tokenizer)
        with tqdm(total=len(requests), desc="generate", unit="req", disable=not progress) as bar:
            completions = engine.generate(requests, progress=bar.update)
    except ValueError as e:
        raise RequestError(str(e)) from e
    finally:
        engine.stop_followers()
    with pathlib.Path(out_path).open("w") as f:
        for c in completions:
            out = {"output_ids": c.output_ids, "text": c.text, "finish_reason": c.finish_reason, "logprobs": c.logprobs}
            f.write(json.dumps(out) + "\n")
    return len(completions)
