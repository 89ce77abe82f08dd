"""Model definitions. One decoder (:mod:`engine.models.decoder`) covers every supported architecture."""
