"""The BERT family: its network, its masking, its LightningModule and its Hugging Face (BertForMaskedLM) adapter."""
