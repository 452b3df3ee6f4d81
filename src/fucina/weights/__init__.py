"""fucina.weights"""
