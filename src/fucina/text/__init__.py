"""fucina.text"""
