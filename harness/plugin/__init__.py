"""The harness's pytest plugin: ``@pytest.mark.ranks`` (``pytest_plugin``), the hooks other plugins implement
(``hookspecs``), and running tests on pytest-xdist workers with timing tests alone at the end (``scheduling``,
``workers``)."""
