"""GRPO post-training: engine rollouts over verifiable-reward domains, the loss, the job (``jaxmoe rl``)."""
