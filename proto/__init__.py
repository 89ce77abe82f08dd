"""Tandem's wire API: ``proto/tandem/v1/*.proto`` and the code generated from it (committed, checked by CI)."""
