"""The real clients under test: each builds a tiny model from a config and saves it with its own API.

Importable (the in-process tests) and a script (the environment tests)::

    python _clients.py PLAN.json

PLAN: [{"client": CLIENT, "reference": REFERENCE, "destinations": [DEST, ...]}, ...]. For each
entry, in order, in this one interpreter: builds CLIENT's model, saves it into every DEST with
the client's API, then ``torch.save``s what the checkpoint must hold to REFERENCE (on local
disk). Prints one JSON line last: {CLIENT: null, or the traceback of what it raised}; a client
that fails does not stop the next one. The script never mentions safestage: in the tests only
SAFESTAGE_DIR in its environment stages its saves (the start-up hook, before any client is
imported, as in an interpreter of its own: one interpreter saves a start-up per client).
Nothing is downloaded (HF_HUB_OFFLINE=1): every model comes from a config, every tokenizer
from a vocabulary written here.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

SETUP_HINT = "install the pinned clients: bash .ci/dev setup (see .ci/constraints-clients.txt)"


class ClientMissing(RuntimeError):
    pass


def need(module: str, distribution: str) -> Any:
    """Import a client or fail loudly: a missing client is a failure, never a skip."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ClientMissing(f"client {distribution!r} is not importable ({error}): {SETUP_HINT}") from error


@dataclass
class Client:
    name: str
    distribution: str
    build: Callable[[Path], Any]  # scratch directory on local disk -> the thing to save
    save: Callable[[Any, Path], None]  # (thing, destination directory) -> client's own save
    reference: Callable[[Any], dict[str, Any]]  # {"tensors": what the .safetensors files hold, ...}
    index: Optional[str] = None  # the index JSON the client writes, if sharded
    min_files: int = 1  # .safetensors files expected at least (> 1: sharding forced)
    json_files: tuple[str, ...] = ()  # JSON the client writes with plain open()
    extra_check: Optional[Callable[[dict[str, Any], Path], None]] = None
    reaches: str = ""  # how the client reaches safetensors (README "Works with")


def tiny_llama() -> Any:
    transformers = need("transformers", "transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def tiny_mlp(tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
    if tied:
        model[3].weight = model[0].weight  # shared storage: the client must dedupe it
    return model


def state(model: torch.nn.Module) -> dict[str, Any]:
    # detach() keeps storage sharing: tied weights stay recognisable as one tensor
    return {"tensors": {k: v.detach() for k, v in model.state_dict().items()}}


# -- transformers -----------------------------------------------------------------------------

def _transformers_save(model: Any, dest: Path) -> None:
    model.save_pretrained(dest, max_shard_size="20KB")


# -- huggingface_hub --------------------------------------------------------------------------

def _hub_state_dict_save(model: torch.nn.Module, dest: Path) -> None:
    hub = need("huggingface_hub", "huggingface_hub")
    hub.save_torch_state_dict(model.state_dict(), dest, max_shard_size="10KB")


def _hub_model_save(model: torch.nn.Module, dest: Path) -> None:
    hub = need("huggingface_hub", "huggingface_hub")
    hub.save_torch_model(model, dest, max_shard_size="10KB")


# -- accelerate -------------------------------------------------------------------------------

@dataclass
class Trained:
    accelerator: Any
    model: Any
    optimizer: Any


def _accelerate_build(_: Path) -> Trained:
    accelerate = need("accelerate", "accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.ones(4, 32)).square().sum())
    optimizer.step()  # optimizer state is not empty: optimizer.bin must round-trip
    return Trained(accelerator, model, optimizer)


def _accelerate_reference(trained: Trained) -> dict[str, Any]:
    ref = state(trained.accelerator.unwrap_model(trained.model))
    ref["optimizer"] = trained.optimizer.state_dict()
    return ref


def _accelerate_state_check(ref: dict[str, Any], dest: Path) -> None:
    """save_state's pickled files: written by torch.save straight to the destination."""
    optimizer = torch.load(dest / "optimizer.bin", weights_only=False)
    assert_nested_equal(optimizer, ref["optimizer"], "optimizer.bin")
    rng = torch.load(dest / "random_states_0.pkl", weights_only=False)
    assert isinstance(rng["torch_manual_seed"], torch.Tensor), sorted(rng)


def assert_nested_equal(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert sorted(got, key=str) == sorted(want, key=str), where
        for key in want:
            assert_nested_equal(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_nested_equal(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


# -- peft -------------------------------------------------------------------------------------

def _peft_build(_: Path) -> Any:
    peft = need("peft", "peft")
    base = tiny_llama()
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(base, config)


def _peft_reference(model: Any) -> dict[str, Any]:
    peft = need("peft", "peft")
    return {"tensors": {k: v.detach() for k, v in peft.get_peft_model_state_dict(model).items()}}


# -- diffusers --------------------------------------------------------------------------------

def _diffusers_build(_: Path) -> Any:
    diffusers = need("diffusers", "diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=8, in_channels=1, out_channels=1, layers_per_block=1,
        block_out_channels=(8, 16), norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    )


def _diffusers_save(model: Any, dest: Path) -> None:
    model.save_pretrained(dest, max_shard_size="20KB")


# -- sentence-transformers --------------------------------------------------------------------

def _st_build(scratch: Path) -> Any:
    """A tiny BERT + tokenizer saved to local disk first, loaded as modules: no download."""
    transformers = need("transformers", "transformers")
    st = need("sentence_transformers", "sentence-transformers")
    modules = need("sentence_transformers.sentence_transformer.modules", "sentence-transformers")
    local = scratch / "tiny-bert"
    local.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", *"abcdefghijklmnopqrstuvwxyz"]
    (local / "vocab.txt").write_text("\n".join(vocab) + "\n")
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    ))
    bert.save_pretrained(local)
    transformers.BertTokenizerFast(vocab_file=str(local / "vocab.txt")).save_pretrained(local)
    transformer = modules.Transformer(str(local))
    pooling = modules.Pooling(transformer.get_embedding_dimension())
    dense = modules.Dense(transformer.get_embedding_dimension(), 8)  # saved by save_model
    return st.SentenceTransformer(modules=[transformer, pooling, dense], device="cpu")


def _st_reference(model: Any) -> dict[str, Any]:
    # model.safetensors (the BERT) and 2_Dense/model.safetensors: their key sets do not overlap
    return {"tensors": {**state(model[0].model)["tensors"], **state(model[2])["tensors"]}}


# -- megatron-bridge --------------------------------------------------------------------------

MEGATRON_STATE = "megatron/bridge/models/hf_pretrained/state.py"


def megatron_state_module() -> Any:
    """megatron/bridge/models/hf_pretrained/state.py, loaded from its file.

    ``import megatron.bridge`` runs the package __init__, which imports AutoBridge ->
    megatron-core -> transformer-engine (CUDA only: cannot install here). state.py itself
    needs only the standard library, torch and safetensors, so we execute that one file as a
    stand-alone module: no package __init__ runs and nothing is stubbed.
    """
    try:
        dist = importlib.metadata.distribution("megatron-bridge")
    except importlib.metadata.PackageNotFoundError as error:
        raise ClientMissing(f"client 'megatron-bridge' is not installed: {SETUP_HINT}") from error
    path = Path(str(dist.locate_file(MEGATRON_STATE)))
    if not path.is_file():
        raise ClientMissing(f"megatron-bridge {dist.version} has no {MEGATRON_STATE}")
    name = "megatron_bridge_hf_pretrained_state"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class MegatronSource:
    source: Any  # SafeTensorsStateSource over a sharded HF-style checkpoint on local disk
    tensors: dict[str, torch.Tensor]  # what the (converted) model yields: the source, doubled


def _megatron_build(scratch: Path) -> MegatronSource:
    from safetensors.torch import save_file

    module = megatron_state_module()
    source_dir = scratch / "hf-source"
    source_dir.mkdir(parents=True, exist_ok=True)
    weights = tiny_mlp().state_dict()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for filename, keys in shards.items():
        save_file({k: weights[k].contiguous() for k in keys}, source_dir / filename)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (source_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return MegatronSource(
        module.SafeTensorsStateSource(source_dir), {k: v.detach() * 2 for k, v in weights.items()}
    )


def _megatron_save(built: MegatronSource, dest: Path) -> None:
    built.source.save_generator(iter(built.tensors.items()), dest)


# -- the registry -----------------------------------------------------------------------------

CLIENTS: dict[str, Client] = {c.name: c for c in [
    Client(
        "transformers", "transformers", lambda _: tiny_llama(), _transformers_save, state,
        index="model.safetensors.index.json", min_files=3,
        json_files=("config.json", "generation_config.json"),
        reaches="bound at import: `from safetensors.torch import save_file as safe_save_file` (modeling_utils)",
    ),
    Client(
        "hub-save_torch_state_dict", "huggingface_hub", lambda _: tiny_mlp(), _hub_state_dict_save, state,
        index="model.safetensors.index.json", min_files=2,
        reaches="imported inside the function: `from safetensors.torch import save_file as save_file_fn`",
    ),
    Client(
        "hub-save_torch_model", "huggingface_hub", lambda _: tiny_mlp(tied=True), _hub_model_save, state,
        index="model.safetensors.index.json", min_files=2,
        reaches="through save_torch_state_dict (import inside the function)",
    ),
    Client(
        "accelerate-save_model", "accelerate", _accelerate_build,
        lambda t, dest: t.accelerator.save_model(t.model, dest, max_shard_size="10KB"),
        _accelerate_reference, index="model.safetensors.index.json", min_files=2,
        reaches="bound at import: `from safetensors.torch import save_file as safe_save_file` (utils/other.py)",
    ),
    Client(
        "accelerate-save_state", "accelerate", _accelerate_build,
        lambda t, dest: t.accelerator.save_state(str(dest)),
        _accelerate_reference, extra_check=_accelerate_state_check,
        reaches="model: bound at import (utils/other.py); optimizer.bin, random_states_0.pkl: torch.save",
    ),
    Client(
        "peft", "peft", _peft_build, lambda m, dest: m.save_pretrained(dest), _peft_reference,
        json_files=("adapter_config.json",),
        reaches="bound at import: `from safetensors.torch import save_file as safe_save_file` (peft_model.py)",
    ),
    Client(
        "diffusers", "diffusers", _diffusers_build, _diffusers_save, state,
        index="diffusion_pytorch_model.safetensors.index.json", min_files=2, json_files=("config.json",),
        reaches="module attribute: `safetensors.torch.save_file(...)` (models/modeling_utils.py)",
    ),
    Client(
        "sentence-transformers", "sentence-transformers", _st_build, lambda m, dest: m.save(str(dest)),
        _st_reference,
        min_files=2,
        json_files=("config.json", "modules.json", "sentence_bert_config.json",
                    "config_sentence_transformers.json", "1_Pooling/config.json", "tokenizer.json",
                    "2_Dense/config.json"),
        reaches="transformers' save_pretrained; Dense: `from safetensors.torch import save_model` at import",
    ),
    Client(
        "megatron-bridge", "megatron-bridge", _megatron_build, _megatron_save,
        lambda built: {"tensors": dict(built.tensors)},
        index="model.safetensors.index.json", min_files=2,
        reaches="imported inside the function: `from safetensors.torch import save_file` (save_generator)",
    ),
]}


def main(argv: list[str]) -> int:
    import traceback

    (plan,) = argv
    errors: dict[str, Optional[str]] = {}
    for entry in json.loads(Path(plan).read_text()):
        name = entry["client"]
        try:
            client = CLIENTS[name]
            with tempfile.TemporaryDirectory() as scratch:
                built = client.build(Path(scratch))
                for dest in entry["destinations"]:
                    client.save(built, Path(dest))
                torch.save(client.reference(built), entry["reference"])
            errors[name] = None
        except BaseException:  # reported for this client's test; the next client goes on
            errors[name] = traceback.format_exc()
    print(json.dumps(errors))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1:]))
