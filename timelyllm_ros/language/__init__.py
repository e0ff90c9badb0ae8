"""The robots' plan language: statements, robot profiles and their skills, the parser and
the checks of a statement, grammars, the segmenter that cuts a plan into executable segments,
execution-time models and recorded plans."""
