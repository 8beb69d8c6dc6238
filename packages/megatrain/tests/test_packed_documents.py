"""Packed documents (data.reset_position_ids, reset_attention_mask, eod_mask_loss): the arrays
equal Megatron-LM's masks, and a packed sequence is scored as its documents alone.

The training loop with them, under tensor/sequence and pipeline parallelism against one
process, is in test_training.py and test_llama.py (their spawns)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatrain.config import ConfigError, load_config, validate
from megatrain.data.samples import PackedDocuments, document_arrays
from megatrain.models import build_model_chunks, model_config
from megatrain.models.attention.masks import document_mask, flex_document_attention

EOD = 0
ALL = PackedDocuments(True, True, True)


def megatron_masks(data: np.ndarray, eod: int):
    """Megatron-LM's get_ltor_masks_and_position_ids with every reset on, transcribed loop for
    loop: (attention allowed [b, s, s], loss mask, position ids)."""
    b, s = data.shape
    allowed = np.tril(np.ones((b, s, s), bool))
    loss_mask = np.ones((b, s), np.float32)
    loss_mask[data == eod] = 0.0
    position_ids = np.tile(np.arange(s), (b, 1))
    for i in range(b):
        eod_index = np.nonzero(data[i] == eod)[0]
        prev_index = 0
        for j in eod_index:
            allowed[i, j + 1 :, : j + 1] = False
            position_ids[i, j + 1 :] -= j + 1 - prev_index
            prev_index = j + 1
    return allowed, loss_mask, position_ids


def test_arrays_equal_megatrons_masks():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 4, (6, 40))  # many EODs, at the start and end too
    data[0, 0] = data[1, -1] = EOD
    allowed, loss_mask, positions = megatron_masks(data, EOD)
    got = document_arrays(data, EOD, ALL)
    assert np.array_equal(got["position_ids"], positions)
    assert np.array_equal(got["loss_mask"], loss_mask)
    mask = document_mask(torch.as_tensor(got["segments"]))
    assert np.array_equal(mask[:, 0].numpy(), allowed)
    assert document_arrays(data, EOD, PackedDocuments()) == {}
    only = document_arrays(data, EOD, PackedDocuments(reset_attention_mask=True))
    assert list(only) == ["segments"]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_equals_the_dense_document_mask():
    """The GPU path (FlexAttention's block mask) against the CPU path (SDPA, s x s mask), run
    here by FlexAttention's eager reference; with grouped-query attention."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 48, 8)
    k, v = torch.randn(2, 2, 48, 8), torch.randn(2, 2, 48, 8)
    segments = torch.as_tensor(np.sort(np.random.default_rng(1).integers(0, 4, (2, 48)), axis=1))
    dense = F.scaled_dot_product_attention(
        q, k, v, attn_mask=document_mask(segments), enable_gqa=True
    )
    flex = flex_document_attention(q, k, v, segments, compiled=False)
    assert (flex - dense).abs().max() < 1e-5
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (causal - dense).abs().max() > 1e-2  # the documents are told apart


LLAMA = [
    "model.kind='llama'",
    "model.num_query_groups=2",
    "model.normalization='rmsnorm'",
    "model.position_embedding_type='rope'",
]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_packed_sequence_scores_as_its_documents_alone(gloo_world_of_one, kind):
    """With positions reset and attention kept within documents, each document's per-token
    losses in the packed sequence are those of the document run alone from position 0."""
    config = load_config(
        None,
        [
            "model.num_layers=2",
            "model.hidden_size=32",
            "model.num_attention_heads=4",
            "model.max_position_embeddings=64",
            "model.hidden_dropout=0.0",
            "model.attention_dropout=0.0",
            *(LLAMA if kind == "llama" else []),
        ],
    )
    model = build_model_chunks(kind, model_config(config, 50))[0].eval()
    rng = np.random.default_rng(2)
    docs = [[*rng.integers(1, 50, n).tolist(), EOD] for n in (9, 4, 14, 6)]
    stream = np.array([t for d in docs for t in d])
    tokens, labels = stream[None, :-1], stream[None, 1:]
    arrays = document_arrays(tokens, EOD, ALL)
    with torch.no_grad():
        packed = model(
            torch.as_tensor(tokens),
            torch.as_tensor(labels),
            position_ids=torch.as_tensor(arrays["position_ids"]),
            segments=torch.as_tensor(arrays["segments"]),
        )[0]
        plain = model(torch.as_tensor(tokens), torch.as_tensor(labels))[0]
        start = 0
        for d in docs:
            n = min(len(d), len(stream) - 1 - start)  # the last document's EOD has no label
            alone = model(
                torch.as_tensor(stream[None, start : start + n]),
                torch.as_tensor(stream[None, start + 1 : start + n + 1]),
            )[0]
            # Within a document every token but the EOD predicts its own document's next one.
            assert torch.allclose(packed[start : start + n - 1], alone[: n - 1], atol=1e-5)
            start += n
    # Without the switches the later documents see the earlier ones: other losses.
    assert (packed[len(docs[0]) :] - plain[len(docs[0]) :]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["model.kind='bert'", "data.reset_attention_mask=true"], "for causal models"),
        (["data.reset_position_ids=true", "training.cuda_graphs=true"], "a captured layer"),
        (
            ["data.eod_mask_loss=true", "training.fused_linear_cross_entropy=true"],
            "the fused loss is the mean over every token",
        ),
    ],
)
def test_packed_documents_refused_where_they_cannot_work(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(load_config(None, overrides), 1)
