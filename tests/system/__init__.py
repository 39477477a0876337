"""The product as a whole: the benchmark, the demo, the status page in a browser, the deployment
files, the README."""
