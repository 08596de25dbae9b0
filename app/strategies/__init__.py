"""How ranks train together beyond what Lightning ships: the pipeline, the parameter server, local updates (local SGD,
DiLoCo) and gradient compression."""
