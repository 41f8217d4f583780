"""logits.* on a real megatron-core GPT, against a plain forward hook on its output layer: the
top-k and the label log-probability rebuilt by the reader's merge equal plain torch on the full
logits; with the vocabulary split in shards (as tensor parallelism splits it) the merge of the
shards' records equals the unsplit result."""

import pytest
import torch

from megatron.core.dmi.hooks import HookSet
from megatron.core.dmi.hooks.groups.logits import vocabulary_views
from megatron.core.dmi.reader.reconstruct import merge_log_softmax, merge_topk
from tests.unit_tests.dmi.hooks.model_fixtures import BATCH, SEQ, VOCAB, capture_for, tiny_gpt, tokens

K = 5


def _oracle_topk(logits, k):
    """Per token: the k largest (value, id), ties by lower id, written out."""
    s, b, v = logits.shape
    out = torch.empty(s, b, k, 2)
    for i in range(s):
        for j in range(b):
            pairs = sorted(((float(logits[i, j, e]), e) for e in range(v)), key=lambda p: (-p[0], p[1]))[:k]
            out[i, j] = torch.tensor(pairs, dtype=torch.float32)
    return out


def test_logits_outputs_match_plain_torch(megatron_cpu):
    model = tiny_gpt()
    capture = capture_for("logits,logits.full", logits_topk=K)
    HookSet(capture).attach(model)
    seen = {}
    model.output_layer.register_forward_hook(lambda m, args, out: seen.update(logits=out[0].detach().clone()))
    ids, pos = tokens()
    labels = torch.roll(ids, -1, dims=1)
    capture.begin_step("train", 1)
    loss = model(ids, pos, attention_mask=None, labels=labels)
    records = {r.key.output: r for r in capture.transport.take(10, 0)}
    assert set(records) == {"logits.topk", "logits.target", "logits.full"}
    logits = seen["logits"]
    assert torch.equal(records["logits.full"].tensor(), logits)
    topk = torch.from_numpy(merge_topk([records["logits.topk"].tensor().numpy()]))
    assert topk.shape == (SEQ, BATCH, K, 2)
    assert torch.equal(topk, _oracle_topk(logits.float(), K))
    target = torch.from_numpy(merge_log_softmax([records["logits.target"].tensor().numpy()]))
    want = torch.log_softmax(logits.double(), dim=-1).gather(-1, labels.t().unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(target, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(target, -loss.detach().t().double(), rtol=0, atol=1e-5)  # no label smoothing
    assert records["logits.target"].key.layer == 1


@pytest.mark.parametrize("shards", [2, 4])
def test_vocabulary_shards_merge_to_the_unsplit_result(shards):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(SEQ, BATCH, VOCAB, generator=g)
    logits[0, 0, 5] = logits[0, 0, 40] = 9.0  # a tie across shards: the lower id comes first
    labels = torch.randint(0, VOCAB, (SEQ, BATCH), generator=g)
    views = [
        vocabulary_views(part, labels, i * (VOCAB // shards), K, ["logits.topk", "logits.target"])
        for i, part in enumerate(logits.chunk(shards, dim=-1))
    ]
    topk = torch.from_numpy(merge_topk([v["logits.topk"].numpy() for v in views]))
    assert torch.equal(topk, _oracle_topk(logits, K))
    assert topk[0, 0, 0].tolist() == [9.0, 5.0] and topk[0, 0, 1].tolist() == [9.0, 40.0]
    target = torch.from_numpy(merge_log_softmax([v["logits.target"].numpy() for v in views]))
    want = torch.log_softmax(logits.double(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(target, want, rtol=0, atol=1e-5)
