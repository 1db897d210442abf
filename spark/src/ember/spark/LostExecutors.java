package ember.spark;

import org.apache.spark.SparkContext;
import org.apache.spark.SparkEnv;

/**
 * What the driver forgets of an executor on a host that no longer answers.
 *
 * <p>Why in Java: pyspark's wheel lacks classes that some of {@code SparkEnv}'s
 * method signatures name (protobuf's, in 4.3), so py4j, which lists a class's
 * methods before calling one, cannot call any method of {@code SparkEnv};
 * compiled code calls it directly.
 */
public final class LostExecutors {
  private LostExecutors() {}

  /**
   * Drops the block manager's record of {@code executorId} and its blocks now.
   * Spark's ContextCleaner removes blocks blocking, and would otherwise hold
   * {@code SparkContext.stop()} for {@code spark.rpc.askTimeout} asking them
   * of an executor nobody reaches.
   */
  public static void forgetBlocks(SparkContext sc, String executorId) {
    SparkEnv env = sc.env();
    env.blockManager().master().removeExecutor(executorId);
  }
}
