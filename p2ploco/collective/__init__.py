"""All-reduce of pseudo-gradients: the Exchange/Communicator seam, the exchanges (codecs) behind it, robust
aggregation."""
