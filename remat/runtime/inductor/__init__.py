"""The inductor room of the runtime: what keeps remat's budget true once inductor compiles
its graphs. fusion.py keeps kernel fusion to what keeps the peak (remat's order holds);
estimate.py lowers each planned graph and reads inductor's own memory estimate to replan
under the fusion margin; plan_store.py saves plans so compile-cache hits still report."""
