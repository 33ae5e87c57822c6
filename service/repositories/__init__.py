"""Data access: one repository per aggregate; repositories flush, never commit."""
