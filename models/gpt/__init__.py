"""The GPT family: its network, its LightningModule and its Hugging Face (GPT-2) adapter."""
