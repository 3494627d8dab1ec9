"""Who is in: a party's keys (made where they are used), their files, the roster assembled from public
files, and its confirmation by fingerprint or signatures."""
