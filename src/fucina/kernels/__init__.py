"""fucina.kernels"""
