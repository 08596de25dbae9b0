"""The mixture-of-experts family: its network (routed SwiGLU experts in a Llama decoder) and its LightningModule."""
