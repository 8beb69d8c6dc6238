"""What an export says about its model comes from the config the model was built from.

Each shipped tiny config (pipelines/models/*-tiny*.toml) is trained one step as a new user
would run it (only the data and the length of the run replaced), saved, exported, and the
export's `tie_word_embeddings` checked against the tensors: a Llama trained from its
shipped config has an output layer of its own (its kind's default for the unset switch) and
must say so, or transformers 4 and vLLM tie the two and silently drop the trained output
layer.  And `import-hf` of a model_type it does not read names the ones it does.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain.checkpoint.files import find_checkpoint
from megatrain.checkpoint.load import read_full_state
from megatrain.config import load_config
from megatrain.hf import HFFormatError, export_hf, import_hf, read_model_types
from megatrain.run.loop import train
from megatrain.testing import world_of_one, write_bert_text_corpus, write_text_corpus

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"
WORDS = ["the", "a", "model", "layer", "of", "tensor", "pipeline", "data", "train", "token"]
# Kinds export-hf writes; a shipped tiny config of another kind would be left unchecked.
EXPORTED_KINDS = ("gpt", "llama", "bert")


def _texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [
        " ".join(" ".join(rng.choice(WORDS, rng.integers(4, 10))) + "." for _ in range(3))
        for _ in range(n)
    ]


def _tiny_configs() -> list[Path]:
    return sorted(MODELS.glob("*-tiny*.toml"))


def _run(path: Path, corpus: Path, out: Path, overrides=()):
    config = load_config(path, [])
    data = (
        [f"data.blend=[[1.0, {str(corpus)!r}]]"]
        if config.data.blend
        else [f"data.corpus={str(corpus)!r}"]
    )
    return load_config(
        path,
        [
            *data,
            "training.train_iters=1",
            "training.seq_length=16",
            "training.micro_batch_size=2",
            "training.global_batch_size=2",
            "training.eval_interval=1000",
            "training.eval_iters=1",
            "optimizer.lr_warmup_iters=0",
            "logging.tensorboard=false",
            f"training.output_dir={str(out / 'run')!r}",
            f"checkpoint.save={str(out / 'ckpt')!r}",
            *overrides,
        ],
    )


def _check_export(out: Path, meta: dict, state: dict) -> dict:
    """The export in `out / "hf"` of the checkpoint (`meta`, `state`): its tie flag beside its
    tensors and as transformers loads it."""
    from safetensors import safe_open

    config = json.loads((out / "hf" / "config.json").read_text())
    with safe_open(str(out / "hf" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        lm_head = f.get_tensor("lm_head.weight") if "lm_head.weight" in names else None
    vocab = int(meta["vocab_size"])
    result = {
        "kind": meta["config"]["model"]["kind"],
        "tied_in_config": config["tie_word_embeddings"],
        "untied_in_checkpoint": "output_layer.weight" in state,
        "lm_head_is_output_layer": lm_head is not None
        and "output_layer.weight" in state
        and torch.equal(lm_head, state["output_layer.weight"][:vocab]),
        "lm_head_differs_from_embedding": lm_head is not None
        and not torch.equal(lm_head, state["embedding.weight"][:vocab]),
        "names": names,
        "ckpt": out / "ckpt",
        "moe": bool(meta["config"]["model"].get("num_moe_experts")),
    }
    if result["kind"] != "bert":  # as transformers loads it: its output layer is ours
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
        ours = state.get("output_layer.weight", state["embedding.weight"])[:vocab]
        result["loaded_output_is_ours"] = torch.equal(hf.get_output_embeddings().weight, ours)
        result["loaded_tied"] = (
            hf.get_output_embeddings().weight.data_ptr()
            == hf.get_input_embeddings().weight.data_ptr()
        )
    return result


def _train_and_export(root: Path) -> dict:
    texts = _texts(40)
    causal, _ = write_text_corpus(root / "corpus", texts, vocab_size=200)
    bert, _, _ = write_bert_text_corpus(root / "bert-corpus", texts, vocab_size=100)
    runs, models = {}, {}
    for path in _tiny_configs():
        config = load_config(path, [])
        if config.model.kind not in EXPORTED_KINDS:
            continue
        # The export reads the [model] section alone: a config that differs only in its data
        # (gpt2-tiny and gpt2-tiny-blend) is the model of one already checked.
        model = json.dumps(config.to_dict()["model"], sort_keys=True)
        if model in models:
            runs[path.stem] = {"same_model_as": models[model]}
            continue
        models[model], out = path.stem, root / path.stem
        corpus = bert if config.model.kind == "bert" else causal
        history = train(_run(path, corpus, out))
        assert history["loss"] and np.isfinite(history["loss"][0]), path  # a step was taken
        meta, state = read_full_state(out / "ckpt", progress=False)
        export_hf(out / "ckpt", out / "hf", progress=False)
        runs[path.stem] = _check_export(out, meta, state)
    # GPT-2 untied (no shipped config): gpt2-tiny's step with an output layer of its own.
    from megatrain.hf.gpt2 import export_gpt2

    gpt = root / runs["gpt2-tiny"].get("same_model_as", "gpt2-tiny")
    meta, state = read_full_state(gpt / "ckpt", progress=False)
    meta["config"]["model"]["untie_embeddings_and_output_weights"] = True
    noise = torch.randn(state["embedding.weight"].shape, generator=torch.Generator().manual_seed(0))
    state["output_layer.weight"] = state["embedding.weight"] + 0.01 * noise
    tokenizer = find_checkpoint(gpt / "ckpt") / "tokenizer.json"
    export_gpt2(meta, state, tokenizer, root / "gpt2-tiny-untied" / "hf", "float32")
    runs["gpt2-tiny-untied"] = _check_export(root / "gpt2-tiny-untied", meta, state)
    return runs


def _result(exports: dict, name: str) -> dict:
    """The checked export of config `name`, or of the config with its model."""
    r = exports[name]
    return exports[r["same_model_as"]] if "same_model_as" in r else r


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    threads = torch.get_num_threads()
    # Tiny models: more threads only contend on a shared CPU (train() keeps the thread count
    # OMP_NUM_THREADS names).
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        try:
            with world_of_one(root / "rendezvous"):  # train() joins it, as a job's rank 0
                return _train_and_export(root)
        finally:
            torch.set_num_threads(threads)


def test_shipped_tiny_configs_export_the_tie_their_tensors_have(exports):
    shipped = {path.stem for path in _tiny_configs()}
    assert shipped | {"gpt2-tiny-untied"} == set(exports)  # every shipped kind is exported
    assert {"gpt2-tiny", "llama-tiny", "bert-tiny", "mixtral-tiny"} <= shipped
    # A Llama (and the Mixtral of the same kind) unties by default; GPT-2 and BERT tie.
    assert exports["llama-tiny"]["untied_in_checkpoint"]
    assert exports["mixtral-tiny"]["untied_in_checkpoint"] and exports["mixtral-tiny"]["moe"]
    assert not _result(exports, "gpt2-tiny")["untied_in_checkpoint"]
    assert exports["gpt2-tiny-untied"]["untied_in_checkpoint"]
    for name, r in exports.items():
        if "same_model_as" in r:
            assert "same_model_as" not in exports[r["same_model_as"]], name
            continue
        untied = r["untied_in_checkpoint"]
        assert r["tied_in_config"] == (not untied), (name, r)
        # An untied export stores our output layer as lm_head (not the embeddings); a tied one
        # stores no lm_head at all.
        assert ("lm_head.weight" in r["names"]) == untied, (name, sorted(r["names"])[:8])
        if untied:
            assert r["lm_head_is_output_layer"] and r["lm_head_differs_from_embedding"], name
        if r["kind"] != "bert":
            assert r["loaded_output_is_ours"], name
            assert r["loaded_tied"] == (not untied), name


def test_an_unknown_model_type_is_refused_naming_the_kinds_read(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(HFFormatError) as refused:
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    message = str(refused.value)
    assert "model_type is 'gpt_neox'" in message and "config.json" in message
    kinds = read_model_types()
    assert {"gpt2", "bert", "megatron-bert", "llama", "mistral"} <= set(kinds)
    assert message.endswith("megatrain import-hf reads " + ", ".join(kinds)), message
    assert not (tmp_path / "ckpt").exists()
    # DeepSeek-V3.2 (its sparse attention's indexer is not read): the latent attention fields
    # it carries are named as what is not supported.
    deepseek = {"model_type": "deepseek_v32", "kv_lora_rank": 512, "q_lora_rank": 1536}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(deepseek))
    with pytest.raises(HFFormatError, match=r"'deepseek_v32' \(with kv_lora_rank, q_lora_rank: "):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")


def test_an_export_refuses_switches_its_family_cannot_compute(exports):
    """A checkpoint whose resolved switches its family's HF class cannot compute is refused
    naming the [model] field: a Llama with biases, a GPT with rotary positions."""
    from megatrain.checkpoint.files import CheckpointError
    from megatrain.hf.gpt2 import export_gpt2
    from megatrain.hf.llama import export_llama

    def llama(meta, state, directory, out):  # streamed: it reads the checkpoint itself
        return export_llama(meta, directory, out, "float32")

    def gpt2(meta, state, directory, out):
        return export_gpt2(meta, state, directory / "tokenizer.json", out, "float32")

    for name, export, field, value in (
        ("llama-tiny", llama, "add_bias_linear", True),
        ("gpt2-tiny", gpt2, "position_embedding_type", "rope"),
    ):
        ckpt = _result(exports, name)["ckpt"]
        meta, state = read_full_state(ckpt, progress=False)
        meta["config"]["model"][field] = value
        with pytest.raises(CheckpointError, match=f"model.{field} is {value!r}"):
            export(meta, state, find_checkpoint(ckpt), ckpt.parent / "refused")
        assert not (ckpt.parent / "refused").exists()
