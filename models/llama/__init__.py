"""The Llama family: its network, its LightningModule and its Hugging Face (LlamaForCausalLM) adapter."""
