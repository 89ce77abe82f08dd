"""Multi-LoRA: PEFT adapters applied per request on top of the base model's linears (opt-in)."""
