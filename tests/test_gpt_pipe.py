"""``ds_ext.models.gpt_pipe``: the GPT as a PipelineModule has GPT's parameters and loss (1-rank world)."""

WORLD_SIZE = 1


def _losses():
    import torch

    from ds_ext.data import ByteCorpus
    from ds_ext.integration import ds_engine
    from ds_ext.models import GPT, GPTConfig
    from ds_ext.models.gpt_pipe import gpt_pipeline, load_gpt_weights

    ds_engine.init_distributed()
    cfg = GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    torch.manual_seed(1)  # other weights, overwritten by the GPT's
    pipe = gpt_pipeline(cfg, num_stages=1)
    load_gpt_weights(pipe, gpt)
    tokens = ByteCorpus().micro_batch(0, 0, 0, 1, 2, 1, cfg.seq_len)
    ours = pipe.loss_fn(pipe(tokens[:, :-1]), tokens[:, 1:])
    ours.backward()
    ref = gpt(tokens)
    ref.backward()
    n_pipe = sum(p.numel() for p in pipe.parameters())
    return (
        float(ours),
        float(ref),
        n_pipe,
        cfg.num_parameters,
        float((pipe.tied_modules.embed.weight.grad - gpt.embed.weight.grad).abs().max()),
    )


def test_gpt_pipeline_has_gpts_parameters_and_loss(world):
    """PP 1: the same parameter count, the same loss to the bit and the tied embedding's gradient
    (token embedding + LM head) equal to GPT's on the same weights."""
    ((ours, ref, n_pipe, n_gpt, grad_diff),) = world.run(_losses)
    assert ours == ref
    assert n_pipe == n_gpt
    assert grad_diff == 0.0
