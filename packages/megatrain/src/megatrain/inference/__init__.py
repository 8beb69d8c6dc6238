"""Using a trained model: loading a checkpoint's model and tokenizer for a layout (`load`) and
sampling text from it with a KV cache (`generate`)."""
