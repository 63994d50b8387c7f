"""What SFT and RL share: model + optimizer setup, the forward-backward step over packed
micro-batches with exact global normalisation, checkpoints, metrics and progress."""
