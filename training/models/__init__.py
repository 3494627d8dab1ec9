"""Models: the built-in ones and an operator's own (checked by digest), a party's own code named on its
command line, where models compute, and their evaluation."""
