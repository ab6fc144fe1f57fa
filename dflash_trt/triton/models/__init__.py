"""Python-backend models. Imported only inside Triton's python-backend stub (they need
`triton_python_backend_utils`); each repository folder's model.py re-exports one TritonPythonModel."""
