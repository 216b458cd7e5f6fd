"""Small models written for the tests and recipes (random weights, same structure as the originals).

``vggt_like``: a VGGT-shaped aggregator (frame / global attention, 2-D RoPE, qk-norm, head_dim 64).
``hsimae_like``: an HSIMAE-shaped masked autoencoder (Conv3d spectral-spatial patches, 36 tokens).
"""
