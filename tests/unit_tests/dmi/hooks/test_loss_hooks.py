"""loss.token on a real megatron-core GPT: bitwise equal to what a plain forward hook on the model
sees (its per-token loss output and the loss_mask it was given), and equal in value to a plain
torch cross entropy of the output layer's logits."""

import torch

from megatron.core.dmi.hooks import HookSet
from tests.unit_tests.dmi.hooks.model_fixtures import BATCH, SEQ, bits, capture_for, tiny_gpt, tokens


def test_loss_token_matches_a_plain_hook_and_torch_cross_entropy(megatron_cpu):
    model = tiny_gpt()
    capture = capture_for("loss")
    HookSet(capture).attach(model)
    seen = {}
    model.register_forward_hook(
        lambda m, args, kwargs, out: seen.update(loss=out.detach().clone(), mask=kwargs["loss_mask"].clone()),
        with_kwargs=True,
    )
    model.output_layer.register_forward_hook(lambda m, args, out: seen.update(logits=out[0].detach().clone()))
    ids, pos = tokens()
    labels = torch.roll(ids, -1, dims=1)
    mask = (torch.arange(SEQ) < SEQ - 3).float().expand(BATCH, SEQ).contiguous()  # last 3 positions masked
    capture.begin_step("train", 1)
    model(ids, pos, attention_mask=None, labels=labels, loss_mask=mask)
    (record,) = capture.transport.take(10, 0)
    got = record.tensor()
    assert record.key.output == "loss.token" and record.key.layer == 1
    assert got.shape == (SEQ, BATCH, 2) and got.dtype == torch.float32
    assert torch.equal(bits(got[..., 0]), bits(seen["loss"].t()))
    assert torch.equal(got[..., 1], seen["mask"].t())
    reference = torch.nn.functional.cross_entropy(
        seen["logits"].float().reshape(SEQ * BATCH, -1), labels.t().reshape(-1), reduction="none"
    ).view(SEQ, BATCH)
    torch.testing.assert_close(got[..., 0], reference, rtol=1e-5, atol=1e-5)


def test_no_mask_is_nan_and_no_labels_records_nothing(megatron_cpu):
    model = tiny_gpt()
    capture = capture_for("loss.token")
    HookSet(capture).attach(model)
    ids, pos = tokens()
    capture.begin_step("train", 1)
    model(ids, pos, attention_mask=None)  # logits only: no loss to record
    assert capture.transport.pending() == 0
    model(ids, pos, attention_mask=None, labels=ids)
    (record,) = capture.transport.take(10, 0)
    assert bool(torch.isnan(record.tensor()[..., 1]).all())
