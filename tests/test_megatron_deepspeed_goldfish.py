"""The Megatron-DeepSpeed acceptance: the real ``pretrain_gpt.py`` (unmodified) with
``"goldfish": {"enabled": true, "k": 2, "h": 13}`` in its ds_config, on both of its paths.

4 ranks, tensor parallelism 2 (ranks 0-1 and 2-3), dense GPT, fp32, DeepSpeed ZeRO-1 with the
client's Adam, global batch 4 of micro-batches of 1, 5 iterations, ``--use-cpu-initialization``
(examples/megatron_deepspeed_goldfish.sh with ``DUMP``, through tests/megatron_goldfish_run.py):

* ``--no-pipeline-parallel``: ``GPTModel``, TP 2 x DP 2; the loss is the script's ``loss_func``
  over the per-token losses of Megatron's vocabulary-parallel cross-entropy and its ``loss_mask``;
* the default path, ``--pipeline-model-parallel-size 2``: ``GPTModelPipe`` on DeepSpeed's
  PipelineEngine, TP 2 x PP 2; the loss is the last stage's ``loss_fn``;
* the same with Megatron's ``--sequence-parallel`` (over the tensor group: each tensor rank holds
  half of the sequence's activations between the layers' tensor-parallel regions) and
  ``--no-position-embedding``. ``get_batch_pipe`` builds ``loss_mask`` from the whole sequence
  (``x_h`` .. of the second half read their context across the shard boundary), then the
  embedding scatters the sequence; ``parallel_lm_logits`` gathers it back before the
  vocabulary-parallel cross-entropy. The client's absolute position embedding cannot run there
  (its ``SequenceParallelPositionEmbedding`` is a table of the rank's half, indexed by the whole
  sequence's ``position_ids``: IndexError), nor can its rotary one on this path
  (``update_rotary_pos_emb`` calls ``.to`` on a list: AttributeError), hence no position embedding.

Not runnable in the unmodified client, so not here (docs/plugins/goldfish.md, "Sequence-sharded
inputs"): ``--sequence-parallel`` with ``--no-pipeline-parallel`` (``get_batch`` shards the tokens
per tensor rank, the embedding shards them again, and the 32 x 32 attention scores meet the
whole sequence's 64 x 64 mask: RuntimeError in ``attention_mask_func``), and DeepSpeed-Ulysses
``--ds-sequence-parallel-size 2`` (without flash attention, which needs CUDA, the client passes the
attention mask where DeepSpeed 0.19.6's ``DistributedAttention.forward`` takes ``batch_dim_idx``:
RuntimeError, "Boolean value of Tensor with more than one value is ambiguous").

The reference is the same run under plain DeepSpeed whose batch functions (``get_batch``,
``get_batch_pipe``) multiply the client's ``loss_mask`` by the hand-written rule
(tests/goldfish_reference.py) over the whole sequence, tokens then labels. On each path: every
``loss_mask`` the client's loss multiplied equals the reference's (so the same on both tensor ranks
of a pair; about half the labels with a whole context dropped, exactly those the rule drops), the printed lm losses
and every parameter of every rank at the end equal the reference's within 1e-6, and the losses and
parameters differ from the plain run's.

Needs what the example script needs (its header): ``MDS``, ``DS0196``, ``EXTRA``, ``DATA``
(examples/megatron_deepspeed_env.sh builds them and prints the exports); skipped otherwise. Nine
runs of 4 ranks (1 to 4 minutes each on 2 shared cores): not part of the quick suite's budget.
"""

import os
import subprocess
from pathlib import Path

import pytest
from clients import MDS_ENV, MDS_READY, MDS_SKIP, lm_losses

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not MDS_READY, reason=MDS_SKIP)
RANKS, ITERATIONS = 4, 5
# case id: (PP, extra pretrain_gpt.py flags)
CASES = {
    "no-pipeline-parallel": (None, ()),
    "pipeline-engine-pp2": (2, ()),
    "pipeline-engine-pp2-sequence-parallel": (2, ("--sequence-parallel", "--no-position-embedding")),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(mode, case)``: (printed losses, each rank's dump), each run once per module."""
    import torch

    done = {}

    def run(mode: str, case: str):
        if (mode, case) not in done:
            pp, flags = CASES[case]
            dump = tmp_path_factory.mktemp(f"{mode}-{case}")
            env = {**os.environ, **MDS_ENV, "DUMP": str(dump), **({"PP": str(pp)} if pp else {})}
            proc = subprocess.run(
                [
                    "bash",
                    str(REPO / "examples" / "megatron_deepspeed_goldfish.sh"),
                    mode,
                    "--train-iters",
                    str(ITERATIONS),
                    *flags,
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            done[(mode, case)] = (
                lm_losses(proc.stdout, ITERATIONS),
                [torch.load(dump / f"rank{r}.pt") for r in range(RANKS)],
            )
        return done[(mode, case)]

    return run


@pytest.mark.parametrize("case", list(CASES))
def test_goldfish_masks_the_clients_own_loss_mask(runs, case):
    import torch

    pp, flags = CASES[case]
    gold_losses, gold = runs("goldfish", case)
    hand_losses, hand = runs("hand", case)
    plain_losses, plain = runs("plain", case)
    micro = ITERATIONS * (4 if pp else 2)  # micro-batches a loss-computing rank sees
    for g, r, p in zip(gold, hand, plain):
        assert (g["tensor_rank"], g["pipeline_rank"], g["data_rank"]) == (
            r["tensor_rank"],
            r["pipeline_rank"],
            r["data_rank"],
        )
        assert g["sequence_parallel"] == r["sequence_parallel"] == ("--sequence-parallel" in flags)
        last = g["pipeline_rank"] == (1 if pp else 0)
        assert len(g["masks"]) == len(r["masks"]) == len(p["masks"]) == (micro if last else 0)
        assert all(torch.equal(a, b) for a, b in zip(g["masks"], r["masks"]))
        if last:  # k = 2 drops half of the labels x_13 .. x_64, whose context is whole: 52 of 64
            dropped = 1 - sum(float(a.sum()) for a in g["masks"]) / sum(float(c.sum()) for c in p["masks"])
            assert dropped == pytest.approx(0.5 * 52 / 64, abs=0.1)
        for name, q in r["final"].items():
            assert torch.equal(g["init"][name], r["init"][name]), name
            torch.testing.assert_close(g["final"][name], q, rtol=1e-6, atol=1e-6, msg=name)
        assert any(not torch.allclose(q, p["final"][n]) for n, q in g["final"].items())
    by_rank = {(d["pipeline_rank"], d["data_rank"], d["tensor_rank"]): d for d in gold}
    for (stage, data, tensor), d in by_rank.items():  # the two tensor ranks of a pair: one mask
        if tensor == 1:
            pair = by_rank[(stage, data, 0)]
            assert all(torch.equal(x, y) for x, y in zip(d["masks"], pair["masks"]))
    assert gold_losses == pytest.approx(hand_losses, rel=1e-6, abs=0)
    assert all(abs(a - b) > 1e-4 for a, b in zip(gold_losses, plain_losses))
