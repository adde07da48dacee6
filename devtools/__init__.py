"""Development tools shared by the tests, the chaos runner and the benchmarks: throwaway
PostgreSQL and Redis servers, real `celery worker` processes. Not part of the package."""
