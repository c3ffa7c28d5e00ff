"""Data: datasets (a batch is a pure function of (seed, step, split)), the token-shard
format, tokenizers, and `ringpipe prepare`.

    datasets.py   the synthetic and byte-level datasets, the stdlib corpus
    shards.py     token shards, data.json, ShardDataset, the Prefetcher
    tokenizer.py  one Tokenizer surface over bytes and Hugging Face tokenizers; BPE training
    prepare.py    `ringpipe prepare`: the command line, and the names its callers import
      prepare_job.py   prepare(): text in, shards out, every step agreed by the ranks
      readers.py       the input files, their checks, their documents read in pieces
      parts.py         a file's tokens into a part, the parts into shards, data.json's contents
      outfolder.py     --out held by rank 0: its lock, its checks, the parts folder
      swap.py          the old dataset replaced whole (renames, a journal)
      stdlib_cache.py  the stdlib corpus prepared once into a cache
      errors.py        PrepareError

Import rule (tests/test_architecture.py): never model/, parallel/, train/, interop/ (job/
is allowed: files, locks, agreement on an error).
"""
