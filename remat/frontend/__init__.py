"""Front end of the pipeline: trace the training step into AOTAutograd's joint graph
(`trace`), profile every node's bytes, aliasing and replay safety (`profile`), estimate
its cost (`costs`), and build the torch-free `remat_solvers.Problem` (`problem`)."""
