package ember.spark;

import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;

import org.apache.spark.rdd.RDD;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.execution.QueryExecution;
import org.apache.spark.sql.types.StructType;

/**
 * A DataFrame's rows as Catalyst rows, and Catalyst rows back as a DataFrame:
 * the two calls of Ember's jobs that are not in the DataFrame API.
 *
 * <p>Why reflection: Spark 4 moved the implementations of {@code Dataset} and
 * {@code SparkSession} to {@code org.apache.spark.sql.classic}, and the
 * classes of {@code org.apache.spark.sql} became the API shared with Spark
 * Connect, which has no {@code internalCreateDataFrame}; Spark 3.5 has no
 * {@code classic} package, so no cast compiles against both.  The objects a
 * classic session hands out have both methods, under the same names and
 * types, in 3.5 and 4, so the calls resolve on the object's own class.
 */
final class Plans {
  private Plans() {}

  /** {@code df.queryExecution().toRdd()}. */
  static RDD<InternalRow> rows(Dataset<Row> df) {
    QueryExecution plan = (QueryExecution) call(df, "queryExecution", new Class<?>[0]);
    return plan.toRdd();
  }

  /** A DataFrame of {@code rows} with {@code schema}, in {@code like}'s session. */
  @SuppressWarnings("unchecked")
  static Dataset<Row> frame(Dataset<Row> like, RDD<InternalRow> rows, StructType schema) {
    return (Dataset<Row>) call(like.sparkSession(), "internalCreateDataFrame",
        new Class<?>[] {RDD.class, StructType.class, boolean.class}, rows, schema, false);
  }

  private static Object call(Object target, String name, Class<?>[] types, Object... args) {
    Method method;
    try {
      method = target.getClass().getMethod(name, types);
    } catch (NoSuchMethodException e) {
      throw new UnsupportedOperationException("ember: " + target.getClass().getName()
          + " has no " + name + "(): Ember's jobs need a classic Spark session (not Spark "
          + "Connect's) of Spark 3.5 or 4", e);
    }
    try {
      return method.invoke(target, args);
    } catch (InvocationTargetException e) {
      Throwable cause = e.getCause();
      if (cause instanceof RuntimeException) {
        throw (RuntimeException) cause;
      }
      if (cause instanceof Error) {
        throw (Error) cause;
      }
      throw new IllegalStateException("ember: " + name + "() failed", cause);
    } catch (IllegalAccessException e) {
      throw new IllegalStateException("ember: " + name + "() is not accessible", e);
    }
  }
}
