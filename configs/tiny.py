"""Tiny hybrid model: every attention kind (mla, dsa, kda) and the MoE, runs in seconds on CPU.

    jaxmoe info --config configs/tiny.py
    jaxmoe train --config configs/tiny.py:train --workdir /tmp/tiny [--config.steps=300]
    jaxmoe rl --config configs/tiny.py:rl --workdir /tmp/tiny_rl --init /tmp/tiny
    jaxmoe train --config configs/tiny.py:vl --workdir /tmp/tiny_vl

Mesh: data 2 x fsdp 2 x tensor 2 over XLA's 8 fake CPU devices; with the argument ``train``
(``configs/tiny.py:train``) the local training mesh data 2 x expert 2 x context 2, experts
dispatched dropless across the expert axis. ``configs/tiny.py:rl`` is that model and mesh with the
``rl`` section of GRPO post-training (``jaxmoe rl``, :class:`jaxmoe.rl.config.RLConfig`).
``configs/tiny.py:vl`` adds a vision tower and the ``vl`` section of the image-text job
(``jaxmoe train`` captions scikit-learn's digits, :mod:`jaxmoe.vision.train`).
"""

import ml_collections


def get_config(arg=None):
    if arg not in (None, "", "train", "rl", "vl"):
        raise ValueError(f"configs/tiny.py takes no argument, 'train', 'rl' or 'vl', got {arg!r}")
    c = ml_collections.ConfigDict()
    c.name = "tiny"
    c.model = dict(
        vocab_size=512,
        d_model=64,
        num_layers=4,
        layer_kinds=("mla", "kda", "dsa", "kda"),
        norm_eps=1e-6,
        max_context=4096,
        rope=dict(theta=10000.0, type="default"),
        mla=dict(
            num_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
        # 8 indexer heads: with fewer, many keys score exactly 0 (every ReLU off) and top-k ties at
        # the boundary make the selected set depend on how the scan is blocked.
        indexer=dict(num_heads=8, head_dim=16, topk=32),
        kda=dict(num_heads=4, head_dim=16, conv_kernel=4, chunk_size=16),
        moe=dict(
            num_experts=8,
            experts_per_token=2,
            num_shared_experts=1,
            expert_ffw_dim=32,
            dense_ffw_dim=128,
            num_groups=4,
            topk_groups=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense=1,
        ),
    )
    c.mesh = dict(data=2, fsdp=2, expert=1, context=1, tensor=2)
    if arg in ("train", "rl"):
        c.mesh = dict(data=2, fsdp=1, expert=2, context=2, tensor=1)
        c.model.moe.dispatch = "dropless"

    # Training (jaxmoe train): a few minutes on 2 CPU cores.
    c.steps = 300
    c.seed = 0
    c.batch_size = 16
    c.seq_len = 64
    c.remat = False
    c.log_every = 1
    c.eval_every = 50
    c.eval_batches = 4
    c.checkpoint_every = 100
    c.keep_checkpoints = 2
    c.export_mxfp4 = True
    c.optim = dict(
        learning_rate=3e-3,
        warmup_steps=20,
        min_lr_ratio=0.1,
        weight_decay=0.1,
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        grad_clip=1.0,
    )
    c.moe_balance = dict(bias_rate=1e-2, seq_aux_loss_weight=1e-4)
    c.dsa = dict(warmup_steps=10, warmup_learning_rate=1e-3, indexer_loss_weight=1.0)
    c.data = dict(max_bytes=2_000_000, heldout_fraction=0.02, cache_dir="")
    if arg == "rl":
        # GRPO from the local run: 6 prompts (2 per domain) x 8 completions a step, a few minutes on CPU.
        c.rl = dict(
            steps=40,
            seed=0,
            domains=("code", "tool_args", "budget"),
            prompts_per_step=6,
            group_size=8,
            max_tokens=48,
            temperature=1.0,
            thinking=dict(low=4, high=8, max=16),
            epsilon_low=0.2,
            epsilon_high=0.28,
            beta=0.0,
            is_cap=2.0,
            optim=dict(learning_rate=2e-4, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0, grad_clip=1.0),
            eval_every=20,
            eval_prompts=16,
            eval_samples=4,
            checkpoint_every=10,
            # The cold start: the run trained on raw Python has never seen a chat turn (rl.sft).
            sft=dict(steps=40, learning_rate=1e-3),
        )
    if arg == "vl":
        # Image-text (jaxmoe.vision.train): the model with a MoonViT tower captions scikit-learn's
        # 8 x 8 digits (2 x 2 patches, 2 x 2 merged: 4 image tokens each); trained from scratch.
        c.model.vision = dict(
            patch_size=2,
            pos_emb_height=4,
            pos_emb_width=4,
            num_heads=2,
            num_layers=2,
            hidden_size=32,
            intermediate_size=64,
            image_token_id=11,  # <|image|> in the job's tokenizer
        )
        c.mesh = dict(data=4, fsdp=1, expert=2, context=1, tensor=1)
        c.model.moe.dispatch = "dropless"
        c.steps = 300
        c.batch_size = 64
        c.eval_every = 100
        c.checkpoint_every = 100
        c.dsa.warmup_steps = 0
        c.vl = dict(dataset="digits", heldout_fraction=0.25, split_seed=0, prompt="What digit is this?")
    return c
