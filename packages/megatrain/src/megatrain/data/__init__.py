"""Training samples from a megadata corpus directory: the corpus and its checks (`corpus`),
GPT samples in the paper's order (`samples`) and BERT's sentence-pair samples (`bert`)."""
