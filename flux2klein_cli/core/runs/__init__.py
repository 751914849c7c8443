"""What the commands do, from typed options to a typed report: generate / edit, parity, bench,
and the files and checks they share (images, PNG files, run cost, quantization error)."""
