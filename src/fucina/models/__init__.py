"""fucina.models"""
