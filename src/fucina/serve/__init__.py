"""fucina.serve"""
