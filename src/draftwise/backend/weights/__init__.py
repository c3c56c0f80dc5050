"""The lean forward's weights: fusing, the products' storage and kernels, page placement."""
