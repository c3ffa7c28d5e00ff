"""Data: datasets (a batch is a pure function of (seed, step, split)), the token-shard
format, tokenizers, and `ringpipe prepare`.

    datasets.py   the synthetic and byte-level datasets, the stdlib corpus
    shards.py     token shards, data.json, ShardDataset, the Prefetcher
    tokenizer.py  one Tokenizer surface over bytes and Hugging Face tokenizers; BPE training
    prepare.py    `ringpipe prepare`: text in, shards out

Import rule (tests/test_architecture.py): never model/, parallel/, train/, interop/ (job/
is allowed: files, locks, agreement on an error).
"""
