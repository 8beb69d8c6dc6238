"""The readers of a recipe's sources, a module per `kind`: `text`, `jsonl`, `html` and
`wikipedia` (with `wiki_markup` and `wiki_prestrip`, which turn wikitext into prose).  Each
yields a file's documents as dicts and reports what it skips or repairs through `problems`;
`reading` holds the bounded reads they share.  The ingest stage (megadata.stages.ingest)
runs them."""
