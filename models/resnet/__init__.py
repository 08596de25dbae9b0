"""The ResNet family: its network and its LightningModule."""
