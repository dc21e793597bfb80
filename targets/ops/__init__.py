"""Op-level target pairs, one file per op family."""
