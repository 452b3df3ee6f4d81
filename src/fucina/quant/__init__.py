"""fucina.quant"""
