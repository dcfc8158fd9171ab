"""Quality measurement: perplexity of float and quantized models, per-layer error reports."""
