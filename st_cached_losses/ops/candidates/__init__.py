"""Which candidates each row scores, for every family: ``layout`` (the per-tile masks and counts, absent documents,
``live_rows``), ``duplicates`` (the duplicate mask from text ids), ``false_negatives`` (GISTEmbed's filter),
``memory`` (banked documents as extra columns) and ``own`` (each row's own documents, in-batch negatives off)."""
