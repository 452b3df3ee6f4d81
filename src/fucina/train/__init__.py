"""fucina.train"""
