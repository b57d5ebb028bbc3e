"""Training the default target model (corpus, tokenizer, training loop)."""
