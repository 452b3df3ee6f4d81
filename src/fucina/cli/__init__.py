"""fucina.cli: the `fucina` command."""
